"""The "same question?" decision for semantic-cache hits.

Every sentence here is written for these tests; none comes from the paraphrase data
sets (which we may not ship).  Cosines are given, not computed: the decision is a pure
function of two texts, a cosine and settings.
"""
import dataclasses
import math
import time

import numpy as np
import pytest

from sidecar.cache.equivalence import EquivalenceSettings, Requirement, Verdict, profile, requirement
from sidecar.cache.same_question import same_question

# The lexical decision (τ and the checks) these tests are about: the verifier, on by default, is off.
DEFAULT = EquivalenceSettings(max_false_hit_rate=0.0)
HIGH = 0.99  # above the default threshold plus any default margin

LONG_CONTEXT = ("We run a small online shop selling handmade candles. Orders ship from our workshop "
                "within two days, and most customers receive them within a week. Last month a courier "
                "lost several parcels and we refunded every one of them the same day. ")

# (a, b, cosine, hit, reason) under the default settings.
CASES = [
    # Rewordings of one question are served.
    ("how to reset my password", "how do I reset my password", HIGH, True, "ok"),
    ("How do I reset my password?", "How can I reset my password?", HIGH, True, "ok"),
    ("What is the capital of France?", "What's the capital city of France?", HIGH, True, "ok"),
    ("What is the best way to learn Python?", "How do I learn Python?", HIGH, True, "ok"),
    ("Give me three tips for sleeping better", "Give me 3 tips for sleeping better", HIGH, True, "ok"),
    ("what is the population of tokyo", "What is the population of Tokyo?", HIGH, True, "ok"),
    ("What is the GDP of the U.S.?", "What is the GDP of the US?", HIGH, True, "ok"),
    ("What did Mr. Smith say about taxes?", "What did Smith say about taxes?", HIGH, True, "ok"),
    ("Tell me about the scientist who discovered penicillin",
     "Tell me about the scientist that discovered penicillin", HIGH, True, "ok"),
    ("What is the difference between TCP and UDP?", "What's the difference between UDP and TCP?",
     HIGH, True, "ok"),
    ("reset my pass\u200bword", "reset my password", HIGH, True, "ok"),  # invisible character
    # The embedding must be close first.
    ("how to reset my password", "how do I reset my password", 0.80, False, "below_threshold"),
    # Numbers, digits or words.
    ("What is 15% of 200?", "What is 20% of 200?", HIGH, False, "numbers_differ"),
    ("Plan a 3 day trip to Rome", "Plan a 5 day trip to Rome", HIGH, False, "numbers_differ"),
    ("Plan a three day trip to Rome", "Plan a five day trip to Rome", HIGH, False, "numbers_differ"),
    ("Who won the World Cup in 2014?", "Who won the World Cup in 2018?", HIGH, False, "numbers_differ"),
    ("Explain the causes of the first world war", "Explain the causes of the second world war",
     HIGH, False, "numbers_differ"),
    ("Convert 5 km to miles", "Convert km to miles", HIGH, False, "numbers_differ"),
    # Negation.
    ("Why is coffee bad for you?", "Why isn't coffee bad for you?", HIGH, False, "negation_differs"),
    ("Is it safe to swim after eating?", "Is it not safe to swim after eating?",
     HIGH, False, "negation_differs"),
    ("Can I take ibuprofen with food?", "Can I take ibuprofen without food?",
     HIGH, False, "negation_differs"),
    ("¿Es seguro nadar después de comer?", "¿No es seguro nadar después de comer?",
     HIGH, False, "negation_differs"),
    # Names.
    ("What is the capital of France?", "What is the capital of Germany?", HIGH, False, "entities_differ"),
    ("Write a Python function to merge two lists", "Write a JavaScript function to merge two lists",
     HIGH, False, "entities_differ"),
    ("How do I install Docker on Ubuntu?", "How do I install Docker on Windows?",
     HIGH, False, "entities_differ"),
    # Question words.
    ("Why do cats purr?", "How do cats purr?", HIGH, False, "question_word_differs"),
    ("When did the Berlin Wall fall?", "Where did the Berlin Wall fall?",
     HIGH, False, "question_word_differs"),
    ("Who invented the telephone?", "When was the telephone invented?",
     HIGH, False, "question_word_differs"),
    ("¿Por qué el cielo es azul?", "¿Cuándo el cielo es azul?", HIGH, False, "question_word_differs"),
    ("Warum ist der Himmel blau?", "Wann ist der Himmel blau?", HIGH, False, "question_word_differs"),
    # Opposites.
    ("What are the best books on statistics?", "What are the worst books on statistics?",
     HIGH, False, "comparison_differs"),
    ("Should I buy shares before the split?", "Should I buy shares after the split?",
     HIGH, False, "comparison_differs"),
    ("how to lose weight fast", "how to lose weight slowly", HIGH, False, "comparison_differs"),
    # Same words, other roles.
    ("convert celsius to fahrenheit", "convert fahrenheit to celsius", HIGH, False, "order_differs"),
    ("flights from Paris to London", "flights from London to Paris", HIGH, False, "order_differs"),
    ("Is tea healthier than coffee?", "Is coffee healthier than tea?", HIGH, False, "order_differs"),
    # Opposites in lower case, and by prefix in any language.
    ("css align text to the left", "css align text to the right", HIGH, False, "comparison_differs"),
    ("sort a list of dicts by key in ascending order", "sort a list of dicts by key in descending order",
     HIGH, False, "comparison_differs"),
    ("write a formal email declining a meeting", "write a casual email declining a meeting",
     HIGH, False, "comparison_differs"),
    ("Wie aktiviere ich die Zwei-Faktor-Authentifizierung?", "Wie deaktiviere ich die Zwei-Faktor-Authentifizierung?",
     HIGH, False, "comparison_differs"),
    ("Comment activer le mode sombre ?", "Comment désactiver le mode sombre ?", HIGH, False, "comparison_differs"),
    # Numbers: sign, decimal point, fractions, percent, order, units.
    ("is .5 mg of melatonin a safe dose", "is 5 mg of melatonin a safe dose", HIGH, False, "numbers_differ"),
    ("convert -40 celsius to fahrenheit", "convert 40 celsius to fahrenheit", HIGH, False, "numbers_differ"),
    ("what is 1/2 + 3/4", "what is 1/4 + 3/2", HIGH, False, "numbers_differ"),
    ("what is 15% of 80", "what is 80% of 15", HIGH, False, "numbers_differ"),
    ("what is 10 minus 3", "what is 3 minus 10", HIGH, False, "numbers_differ"),
    ("what is 2 to the power of 10", "what is 10 to the power of 2", HIGH, False, "numbers_differ"),
    ("set a timeout of 30 seconds in requests", "set a timeout of 30 minutes in requests",
     HIGH, False, "numbers_differ"),
    ("what is 100 fahrenheit in celsius", "what is 100 celsius in fahrenheit", HIGH, False, "numbers_differ"),
    ("what is 3 plus 5", "what is 5 plus 3", HIGH, True, "ok"),
    ("compare python 2 and python 3", "compare python 3 and python 2", HIGH, True, "ok"),
    ("write an essay of about 100 words on climate change",
     "write an essay of about a hundred words on climate change", HIGH, True, "ok"),
    ("what happened in the 19th century in france", "what happened in the nineteenth century in france",
     HIGH, True, "ok"),
    # Directions.
    ("how many teaspoons in a tablespoon", "how many tablespoons in a teaspoon", HIGH, False, "order_differs"),
    ("translate good morning to spanish", "translate good morning from spanish", HIGH, False, "order_differs"),
    ("Comment convertir des miles en kilomètres ?", "Comment convertir des kilomètres en miles ?",
     HIGH, False, "order_differs"),
    ("how to center a div horizontally", "how to horizontally center a div", HIGH, True, "ok"),   # infinitive
    # Operators.
    ("what does == do in javascript", "what does === do in javascript", HIGH, False, "symbols_differ"),
    ("what does i++ do in c", "what does ++i do in c", HIGH, False, "symbols_differ"),
    ("what does *args mean in python", "what does **args mean in python", HIGH, False, "symbols_differ"),
    ("What's 2+2?", "what is 2 + 2", HIGH, True, "ok"),
    ("what does 2>&1 mean in bash", "what does 2>&1 mean in bash?", HIGH, True, "ok"),
    ("how do I use two-factor auth with os.path", "how do I use two-factor auth with os.path!", HIGH, True, "ok"),
    # Synonyms from unrelated classes are no opposites; gradable ones still differ.
    ("How do I drop duplicates in pandas?", "How do I remove duplicates in pandas?", HIGH, True, "ok"),
    ("How to open a JSON file in Python?", "How to read a JSON file in Python?", HIGH, True, "ok"),
    ("What's the right way to center a div?", "What's the best way to center a div?", HIGH, True, "ok"),
    ("What is the least common multiple of 4 and 6?", "What is the lowest common multiple of 4 and 6?",
     HIGH, True, "ok"),
    ("what is the probability of exactly one six in four rolls",
     "what is the probability of at least one six in four rolls", HIGH, False, "comparison_differs"),
    ("What is the fastest car?", "What is the cheapest car?", HIGH, False, "comparison_differs"),
    ("explain recursion in simple terms", "explain recursion in technical terms", HIGH, False, "comparison_differs"),
    ("how to undo the last git commit keeping the changes", "how to undo the last git commit losing the changes",
     HIGH, False, "comparison_differs"),
    ("what does ?. do in typescript", "what does ?? do in typescript", HIGH, False, "symbols_differ"),
    # Emoji are [UNK] to the model, so only this check tells them apart.
    ("Write a birthday message 🎉", "Write a birthday message 🎂", 1.0, False, "symbols_differ"),
    ("Write a birthday message 🎉", "Write a birthday message", 1.0, True, "ok"),
    # Prefixes that also begin unrelated words, and spelling variants, are no opposites.
    ("How do I play a video in HTML?", "How do I display a video in HTML?", HIGH, True, "ok"),
    ("How do I write a formal enquiry email?", "How do I write a formal inquiry email?", HIGH, True, "ok"),
    # Prose punctuation is no operator.
    ("What does x += 1 do in Python?", "What does x += 1 do in Python ?", HIGH, True, "ok"),
    ('What is the difference between "==" and "is"?', "What is the difference between == and is?",
     HIGH, True, "ok"),
    ("How does x += 1 work, e.g., in a loop?", "How does x += 1 work, for example in a loop?", HIGH, True, "ok"),
    # "-free" is "without".
    ("Give me gluten-free pancake recipes", "Give me gluten free pancake recipes", HIGH, True, "ok"),
    ("Where can I learn Python free of charge?", "Where can I learn Python for free?", HIGH, True, "ok"),
    ("give me a gluten-free pancake recipe", "give me a pancake recipe with gluten", HIGH, False, "negation_differs"),
    ("give me a gluten-free pancake recipe", "give me a pancake recipe without gluten", HIGH, True, "ok"),
    # Times of day and units written after or glued to a number; a model's suffix.
    ("set an alarm for 9am", "set an alarm for 9pm", HIGH, False, "numbers_differ"),
    ("is 6:30 am too early for a meeting", "is 6:30 pm too early for a meeting", HIGH, False, "numbers_differ"),
    ("is 30°C hot for a run", "is 30°F hot for a run", HIGH, False, "numbers_differ"),
    ("how much energy is 1 kJ", "how much energy is 1 kcal", HIGH, False, "numbers_differ"),
    ("does the Pixel 8 have wireless charging", "does the Pixel 8a have wireless charging",
     HIGH, False, "numbers_differ"),
    ("set the timeout to 100ms", "set the timeout to 100 ms", HIGH, True, "ok"),
    ("is 30°C hot for a run", "is 30 celsius hot for a run", HIGH, True, "ok"),
    # Number words in other languages.
    ("¿Cuánto cuestan dos cafés?", "¿Cuánto cuestan cuatro cafés?", HIGH, False, "numbers_differ"),
    ("Wie viel kosten zwei Kaffee?", "Wie viel kosten 2 Kaffee?", HIGH, True, "ok"),
    # One-letter labels.
    ("should I pick option A or B", "should I pick option B or C", HIGH, False, "entities_differ"),
    ("solve 2x + 3 = 7 for x", "solve 2x + 3 = 7 for y", HIGH, False, "entities_differ"),
    ("what size is an M in european sizes", "what size is an L in european sizes", HIGH, False, "entities_differ"),
    ("Which university is best for an M.S in physics?", "Which university is best for an m.s. in physics?",
     HIGH, True, "ok"),
    # Particles after the same verb, and opposites in other languages.
    ("how do I turn on dark mode", "how do I turn off dark mode", HIGH, False, "comparison_differs"),
    ("how to zoom in on a pdf", "how to zoom out on a pdf", HIGH, False, "comparison_differs"),
    ("arguments for nuclear power", "arguments against nuclear power", HIGH, False, "comparison_differs"),
    ("how do I find out the length of a list in python", "how do I get the length of a list in python",
     HIGH, True, "ok"),
    ("¿Qué hago antes de una entrevista?", "¿Qué hago después de una entrevista?", HIGH, False, "comparison_differs"),
    ("¿Es buen momento para comprar una casa?", "¿Es buen momento para vender una casa?",
     HIGH, False, "comparison_differs"),
    # Two things exchanged, all else equal; not neighbours, nor things joined by "or".
    ("can I use baking soda instead of baking powder", "can I use baking powder instead of baking soda",
     HIGH, False, "order_differs"),
    ("copy column A to column B in excel", "copy column B to column A in excel", HIGH, False, "order_differs"),
    ("my cat bites me when I pet her", "my cat bites her when she pets me", HIGH, False, "order_differs"),
    ("is a tomato a fruit or a vegetable", "is a tomato a vegetable or a fruit", HIGH, True, "ok"),
    ("how to delete a local git branch", "how to delete a git local branch", HIGH, True, "ok"),
    ("What are the best email finding tools?", "What are the best tools for finding email?", HIGH, True, "ok"),
    ("what is the difference between http and https", "what is the difference between https and http",
     HIGH, True, "ok"),
    ("redirect http to https in nginx", "redirect https to http in nginx", HIGH, False, "order_differs"),
    ("plot s as a function of t", "plot t as a function of s", HIGH, False, "order_differs"),   # labels, not "it's"
    ("The sky is blue and the grass is green", "The grass is blue and the sky is green",
     HIGH, False, "order_differs"),
    ("Compare Python with Java", "Compare Java with Python", HIGH, True, "ok"),
    ("is 30 °C hot for a run", "is 30°C hot for a run", HIGH, True, "ok"),
    ("how to install Python 3.x on windows", "how to install Python 3 on windows", HIGH, True, "ok"),
    ("can u help me write a poem", "can you help me write a poem", HIGH, True, "ok"),
    # Tense, quantifiers, "only", "and" for "or".
    ("Who is the CEO of Twitter?", "Who was the CEO of Twitter?", HIGH, False, "tense_differs"),
    ("What was the temperature at 9 am", "What is the temperature at 9 am", HIGH, False, "tense_differs"),
    ("When will the next iPhone come out?", "When is the next iPhone going to come out?", HIGH, True, "ok"),
    ("do all cats purr", "do some cats purr", HIGH, False, "quantifiers_differ"),
    ("what can I eat on a keto diet", "what can I only eat on a keto diet", HIGH, False, "quantifiers_differ"),
    ("if x > 0 and y > 0 what quadrant is the point", "if x > 0 or y > 0 what quadrant is the point",
     HIGH, False, "quantifiers_differ"),
    # Past max_prompt_chars, exact hits only: the checks would hold the event loop.
    ("Summarise this: " + "lorem ipsum dolor " * 300, "Summarise this: " + "lorem ipsum dolor " * 300 + "!",
     1.0, False, "too_long"),
    # After a long context the last sentence, the instruction, must match word for word.
    (LONG_CONTEXT + "Write a polite reply to a customer whose parcel is late.",
     LONG_CONTEXT + "Write a firm reply to a customer whose parcel is late.", HIGH, False, "content_differs"),
    (LONG_CONTEXT + "Write a polite reply to a customer whose parcel is late.",
     LONG_CONTEXT + "Please write a polite reply to the customer whose parcel is late!", HIGH, True, "ok"),
]


@pytest.mark.parametrize("a, b, cosine, hit, reason", CASES)
def test_same_question(a, b, cosine, hit, reason):
    assert same_question(a, b, cosine, DEFAULT) == Verdict(hit, reason)


@pytest.mark.parametrize("a, b, cosine, hit, reason", CASES)
def test_order_of_the_prompts_does_not_matter(a, b, cosine, hit, reason):
    assert same_question(b, a, cosine, DEFAULT) == same_question(a, b, cosine, DEFAULT)


@pytest.mark.parametrize("text", [
    "a " + "hundred " * 2200,                 # a number past the 4,300 digits str() takes
    "one " + "thousand " * 2000,
    "x" * 200_000 + " and y",                  # one huge word: the prefix match is bounded
])
def test_adversarial_prompts_are_profiled_quickly_without_error(text):
    assert same_question(text, text + " please", HIGH, DEFAULT).reason == "too_long"   # by default
    start = time.perf_counter()
    verdict = same_question(text, text + " please", HIGH, dataclasses.replace(DEFAULT, max_prompt_chars=10**9))
    assert verdict.reason in ("ok", "content_differs") and time.perf_counter() - start < 5


# Switching a check off lets its pair through.
@pytest.mark.parametrize("switch, a, b", [
    ("check_numbers", "What is 15% of 200?", "What is 20% of 200?"),
    ("check_negation", "Why is coffee bad for you?", "Why isn't coffee bad for you?"),
    ("check_entities", "What is the capital of France?", "What is the capital of Germany?"),
    ("check_question_words", "Why do cats purr?", "How do cats purr?"),
    ("check_comparisons", "What are the best books on statistics?", "What are the worst books on statistics?"),
    ("check_word_order", "convert celsius to fahrenheit", "convert fahrenheit to celsius"),
    ("check_symbols", "what does == do in javascript", "what does === do in javascript"),
    ("check_tense", "Who is the CEO of Twitter?", "Who was the CEO of Twitter?"),
    ("check_quantifiers", "do all cats purr", "do some cats purr"),
])
def test_each_check_has_a_switch(switch, a, b):
    assert not same_question(a, b, HIGH, DEFAULT).hit
    assert same_question(a, b, HIGH, dataclasses.replace(DEFAULT, **{switch: False})) == Verdict(True, "ok")


# Content words: lower-case names reach only this check.
SWAP = ("how do i install docker on ubuntu", "how do i install docker on windows")
NARROWER = ("how do i center a div", "how do i center a div vertically in a flex container")


@pytest.mark.parametrize("settings, cosine, hit", [
    (dataclasses.replace(DEFAULT, threshold=0.90, substitution_margin=0.0), 0.95, True),
    (dataclasses.replace(DEFAULT, threshold=0.90, substitution_margin=0.04), 0.93, False),
    (dataclasses.replace(DEFAULT, threshold=0.90, substitution_margin=0.04), 0.95, True),
    (dataclasses.replace(DEFAULT, threshold=0.90, substitution_margin=1.0), 0.9999, False),
])
def test_a_swapped_word_needs_the_substitution_margin(settings, cosine, hit):
    verdict = same_question(*SWAP, cosine, settings)
    assert verdict == Verdict(hit, "ok" if hit else "content_differs")


@pytest.mark.parametrize("settings, cosine, hit", [
    (dataclasses.replace(DEFAULT, threshold=0.90, extra_word_cost=0.0), 0.91, True),
    # "vertically", "flex", "container": three extra words, 0.02 each.
    (dataclasses.replace(DEFAULT, threshold=0.90, extra_word_cost=0.02), 0.95, False),
    (dataclasses.replace(DEFAULT, threshold=0.90, extra_word_cost=0.02), 0.97, True),
    (dataclasses.replace(DEFAULT, threshold=0.90, max_extra_words=2), HIGH, False),
])
def test_extra_words_raise_the_bar(settings, cosine, hit):
    verdict = same_question(*NARROWER, cosine, settings)
    assert verdict == Verdict(hit, "ok" if hit else "content_differs")


def test_requirement_is_what_same_question_compares_with():
    strict = dataclasses.replace(DEFAULT, threshold=0.90, extra_word_cost=0.02)
    need = requirement(*NARROWER, strict)
    assert need.reason == "content_differs" and need.min_cosine == pytest.approx(0.96)
    assert not same_question(*NARROWER, need.min_cosine - 1e-9, strict).hit
    assert same_question(*NARROWER, need.min_cosine, strict).hit
    assert requirement("how to reset my password", "how do I reset my password", DEFAULT) == \
        Requirement(DEFAULT.threshold, "ok")
    assert requirement("What is 15% of 200?", "What is 20% of 200?", DEFAULT) == \
        Requirement(math.inf, "numbers_differ")


@pytest.mark.parametrize("a, b", [
    ("It costs $1,000", "It costs 1000 dollars"),
    ("twenty-five people", "25 people"),
    ("one hundred and five", "105"),
    ("$3bn deal", "3 billion deal"),
    ("the 3rd floor", "the third floor"),
    ("2.50 euros", "2.5 euros"),
    ("which one is better", "which is better"),  # a lone "one" is not a count
])
def test_numbers_are_compared_by_value(a, b):
    assert profile(a).numbers == profile(b).numbers


def test_relative_pronouns_are_not_question_words():
    assert profile("The man who sold the car left").question_words == frozenset()
    assert profile("Who sold the car?").question_words == {"who"}
    assert profile("What is it and why?").question_words == {"what", "why"}


def test_sentence_start_capitals_are_not_names():
    assert profile("Summarize the French Revolution").entities == {"french", "revolution"}
    assert profile("Paris. Tell me about NASA and iPhone sales").entities == {"nasa", "iphone"}


@pytest.mark.parametrize("field, value", [
    ("threshold", 0.0), ("threshold", 1.5), ("extra_word_cost", -0.1),
    ("max_extra_words", -1), ("substitution_margin", -0.01), ("long_prompt_words", -1), ("max_prompt_chars", -1),
])
def test_settings_are_validated_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EquivalenceSettings(**{field: value})


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.threshold = 0.5


def test_long_prompts_must_match_word_for_word():
    # The embedding sees only the end of a long prompt: a change near the start leaves
    # the cosine at about 1, so the content words decide (at exactly 1 the model saw
    # nothing of the change: unseen_words, whatever the knobs).
    context = " ".join(["The quarterly report covers revenue, hiring and the platform roadmap."] * 20)
    a = "Our revenue grew this year. " + context + " Summarize the report."
    b = "Our revenue shrank this year. " + context + " Summarize the report."
    assert same_question(a, a, 1.0, DEFAULT) == Verdict(True, "ok")
    assert same_question(a, b, 0.999, DEFAULT) == Verdict(False, "content_differs")
    short = dataclasses.replace(DEFAULT, long_prompt_words=10_000)
    assert same_question(a, b, 0.999, short) == Verdict(True, "ok")
    assert same_question(a, b, 1.0, short) == Verdict(False, "unseen_words")


def _words(rng) -> list[str]:
    return [f"{w}{i}" for i, w in enumerate("river capital mountain paris how why best 3.5 km not".split())]


def _order_numbers(rng) -> list[str]:
    # Every token an identifier: the profile holds hundreds of them.
    return [f"a{n}" for n in rng.integers(10_000, 100_000, 2000)]


@pytest.mark.parametrize("vocabulary", [_words, _order_numbers])
def test_the_profile_cache_is_bounded_in_bytes_and_charges_what_profiles_take(vocabulary):
    """Profiles of distinct long prompts (a caller can send any) stay within the cache's byte
    share, and the charge covers what a profile really takes (traced)."""
    import gc
    import tracemalloc

    from sidecar.cache import equivalence
    rng = np.random.default_rng(5)
    words = vocabulary(rng)
    texts = [" ".join(rng.choice(words, 700))[:3990] + f" {n}?" for n in range(40)]
    try:
        equivalence.forget_profiles(max_bytes=2 * 2**20)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for text in texts:
            profile(text)
        gc.collect()
        taken = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        cache = equivalence._profiles
        assert 0 < len(cache) < len(texts) and cache.nbytes <= 2 * 2**20
        assert 0.5 * cache.nbytes < taken <= cache.nbytes + 64 * 1024   # the charge covers what is held
        assert profile(texts[-1]) is profile(texts[-1])      # the most recent are still cached
    finally:
        equivalence.forget_profiles()


# Words the model reads as [UNK] give two different prompts the same vector (cosine 1.0):
# the cosine vouches for nothing then. Case and accents the model folds are no difference.
@pytest.mark.parametrize("a, b, hit", [
    ("서울에서 부산까지 KTX로 얼마나 걸려요?", "서울에서 대구까지 KTX로 얼마나 걸려요?", False),
    ("혈압을 낮추는 음식은 뭐예요?", "혈압을 높이는 음식은 뭐예요?", False),
    ("カレーを辛くする方法は？", "カレーを甘くする方法は？", False),
    ("comment faire un cv efficace", "comment faire un CV éfficace", True),
    ("Is Polish hard to learn?", "Is polish hard to learn?", True),
])
@pytest.mark.parametrize("rate", [0.0, 0.05])
def test_the_same_vector_for_different_words_is_no_hit(a, b, hit, rate):
    settings = dataclasses.replace(DEFAULT, max_false_hit_rate=rate)
    verdict = same_question(a, b, 1.0, settings)
    assert (verdict.reason == "unseen_words") == (not hit)
    if rate == 0:
        assert verdict.hit == hit


def test_a_number_in_a_sentence_without_spaces_is_no_identifier():
    # Chinese and Japanese write no spaces between words: a clause with a year or a model number
    # in it is one run of letters and digits, but no identifier; a rewording of it is no
    # difference. An order number in such a sentence still is one.
    for x, y in (("2023年和2024年的GDP增长率是多少", "2024年和2023年的GDP增长率分别是多少"),
                 ("iPhone 15の価格はいくらですか", "iPhone 15はいくらですか"),
                 ("我今年35岁了应该买什么保险", "35岁的人应该买什么保险")):
        assert same_question(x, y, 0.99, DEFAULT).reason != "identifiers_differ", (x, y)
    for x, y in (("请查询订单INV20240042的状态", "请查询订单INV20240043的状态"),
                 ("订单号123456的物流信息", "订单号654321的物流信息")):
        assert same_question(x, y, 0.99, DEFAULT).reason == "identifiers_differ", (x, y)
