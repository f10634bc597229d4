"""Embedding engine, the parts that need no model: normalisation, prompt split, tokens,
batch planning, pooling, settings, GPU batch limit."""
from __future__ import annotations

import sys
import unicodedata

import numpy as np
import pytest

from sidecar.config import ConfigError
from sidecar.embedding.errors import NothingToEmbed
from sidecar.embedding.gpu_memory import BYTES_PER_TOKEN, batch_limit_for_memory
from sidecar.embedding.model_files import VENDORED_TOKENIZER
from sidecar.embedding.normalize import (_REMOVED, REMOVED_RANGES, SUBSCRIPT_RANGES, SUPERSCRIPT_RANGES,
                                         normalize_text)
from sidecar.embedding.planning import plan_batches
from sidecar.embedding.prompt import split_prompt
from sidecar.embedding.settings import EmbeddingSettings
from sidecar.embedding.tensors import mean_pool_normalize, pad_batch
from sidecar.embedding.tokens import encode_tail, load_tokenizer


# --- normalize_text -------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ("Hello world", "Hello world"),
    ("  padded \n\t", "padded"),
    ("ＨＥＬＬＯ ｗｏｒｌｄ", "HELLO world"),                 # full-width forms (NFKC)
    ("ﬁne ligature", "fine ligature"),                     # ligature (NFKC)
    ("x\u00a0y\u3000z", "x y z"),                          # no-break, ideographic space
    ("pass\u200bword", "password"),                        # zero-width space
    ("a\u200c\u200db\u2060c\ufeffd", "abcd"),              # ZWNJ, ZWJ, word joiner, BOM
    ("\u202eevil\u202c \u200fRTL\u200e \u2066iso\u2069", "evil RTL iso"),  # bidi controls
    ("soft\u00adhyphen", "softhyphen"),
    ("tag\U000E0041\U000E0042s", "tags"),                  # tag characters (smuggling)
    ("bell\x07 null\x00 del\x7f c1\x9b", "bell null del c1"),
    ("line1\r\nline2\rline3\u2028line4\x85end", "line1\nline2\nline3\nline4\nend"),
    ("keep\ttabs\nand lines", "keep\ttabs\nand lines"),
    ("lone \ud800 surrogate", "lone  surrogate"),
    ("e\u0301 composed", "\u00e9 composed"),               # NFKC composes
    ("heart \u2764\ufe0f", "heart \u2764"),                # variation selector
    ("😀 emoji 👨‍👩‍👧", "😀 emoji 👨👩👧"),                   # ZWJ sequence split, emoji kept
    ("مرحبا שלום 你好 こんにちは", "مرحبا שלום 你好 こんにちは"),  # scripts kept
    ("\u200b \u200f \ufeff", ""),
    ("", ""),
    ("What is 2³?", "What is 2^3?"),                     # never "23" (NFKC alone would say so)
    ("x²ⁿ + x²n + H₂O at 10⁻³ m", "x^(2n) + x^2n + H_2O at 10^(\u22123) m"),
    ("2ˣ and ʰ and café 你好", "2^x and ^h and café 你好"),   # modifier letters; NFKC text kept
    ("Acme™ 1ª ½ ① ℌ ㎏", "AcmeTM 1a 1\u20442 1 H kg"),      # left to NFKC
])
def test_normalize_text(raw, expected):
    assert normalize_text(raw) == expected


def test_removed_ranges_cover_every_control_and_format_character():
    # The table is written out; this catches a Unicode update that adds Cc/Cf code points.
    kept = {"\t", "\n"}
    for cp in range(sys.maxunicode + 1):
        char = chr(cp)
        if unicodedata.category(char) in ("Cc", "Cf", "Cs") and char not in kept:
            assert _REMOVED.match(char), f"U+{cp:04X} should be removed"
    assert not _REMOVED.match("\t") and not _REMOVED.match("\n")
    assert all(a <= b for a, b in REMOVED_RANGES)


def test_script_ranges_hold_every_one_character_superscript_and_subscript():
    listed = {tag: {cp for a, b in ranges for cp in range(a, b + 1)}
              for tag, ranges in (("<super>", SUPERSCRIPT_RANGES), ("<sub>", SUBSCRIPT_RANGES))}
    for cp in range(sys.maxunicode + 1):
        tag = unicodedata.decomposition(chr(cp)).split(" ")[0]
        one_character = len(unicodedata.normalize("NFKC", chr(cp))) == 1
        expected = tag if tag in listed and one_character and cp not in (0xAA, 0xBA) else None
        found = next((t for t, cps in listed.items() if cp in cps), None)
        assert found == expected, f"U+{cp:04X}"


def test_nfkc_never_produces_a_removed_character():
    # normalize_text removes before NFKC only; this is what makes that enough.
    for cp in range(sys.maxunicode + 1):
        char = chr(cp)
        if not _REMOVED.match(char):
            assert not _REMOVED.search(unicodedata.normalize("NFKC", char)), f"U+{cp:04X}"


def test_normalize_is_idempotent_across_all_planes():
    sample = "".join(chr(cp) for cp in range(0, sys.maxunicode + 1, 97))
    once = normalize_text(sample)
    assert normalize_text(once) == once
    once.encode("utf-8")  # no lone surrogate survives


# --- split_prompt ---------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are terse."}


def user(content):
    return {"role": "user", "content": content}


def test_embeds_the_last_user_turn_and_keys_the_rest():
    messages = [SYSTEM, user("first question"), {"role": "assistant", "content": "answer"},
                user("second question")]
    parts = split_prompt(messages)
    assert parts.text == "second question"
    assert len(parts.context_key) == 64 and int(parts.context_key, 16) >= 0


def test_text_parts_are_joined_and_image_parts_go_to_the_key():
    image_a = {"type": "image_url", "image_url": {"url": "https://x/a.png"}}
    image_b = {"type": "image_url", "image_url": {"url": "https://x/b.png"}}
    parts_a = split_prompt([user([{"type": "text", "text": "What is"}, image_a,
                                  {"type": "text", "text": "in this image?"}])])
    parts_b = split_prompt([user([{"type": "text", "text": "What is"}, image_b,
                                  {"type": "text", "text": "in this image?"}])])
    assert parts_a.text == parts_b.text == "What is\nin this image?"
    assert parts_a.context_key != parts_b.context_key


@pytest.mark.parametrize("other", [
    [{"role": "system", "content": "You are verbose."}, user("q")],
    [user("q")],
    [SYSTEM, user("earlier"), {"role": "assistant", "content": "a"}, user("q")],
    [SYSTEM, user("q"), {"role": "assistant", "content": "prefill"}],
    [SYSTEM, {"role": "user", "content": "q", "name": "bob"}],
])
def test_context_changes_change_the_key(other):
    base = split_prompt([SYSTEM, user("q")])
    changed = split_prompt(other)
    assert changed.text == "q"
    assert changed.context_key != base.context_key


def test_key_is_stable_and_ignores_dict_key_order():
    one = split_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}])
    two = split_prompt([{"content": "S", "role": "system"}, {"content": "q", "role": "user"}])
    assert one == two
    # The key does not depend on the embedded text, only on its context.
    assert split_prompt([SYSTEM, user("other q")]).context_key == split_prompt([SYSTEM, user("q")]).context_key


@pytest.mark.parametrize("messages", [
    [], [SYSTEM], [user("")], [user("   \n")], [user(None)], [user([])],
    [user([{"type": "image_url", "image_url": {"url": "u"}}])],
    "not a list", None, [42, "x"], [user({"unexpected": "object"})],
    [{"role": "user", "content": "q", 1: "mixed key types"}],
])
def test_odd_messages_raise_nothing_to_embed(messages):
    with pytest.raises(NothingToEmbed):
        split_prompt(messages)


def test_lone_surrogates_and_any_code_point_give_a_key():
    parts = split_prompt([{"role": "system", "content": "\ud800 \U0010ffff"}, user("q \udfff")])
    assert len(parts.context_key) == 64


# --- tokens ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(VENDORED_TOKENIZER, 256)


def full_text_ids(tokenizer, text):
    return tokenizer.encode(normalize_text(text)).ids


def test_short_text_has_cls_and_sep(tokenizer):
    ids = encode_tail(tokenizer, "Hello world", 256)
    assert tokenizer.decode(ids) == "hello world"
    assert ids[0] == tokenizer.token_to_id("[CLS]") and ids[-1] == tokenizer.token_to_id("[SEP]")


def test_long_text_keeps_its_end(tokenizer):
    question = "so which region had the highest costs?"
    ids = encode_tail(tokenizer, "filler words here. " * 500 + question, 256)
    assert len(ids) == 256
    assert tokenizer.decode(ids).endswith("which region had the highest costs?")


@pytest.mark.parametrize("text", [
    "word " * 3000,
    "lorem ipsum dolor sit amet, " * 800 + "the end",
    "中国人大学生" * 2000,                         # CJK: no spaces, one token a character (all in the vocabulary)
    "x" * 150 + " " + "y " * 2000,                 # a long word, then many short ones
    "supercalifragilistic " * 1500,                # several tokens a word
    "a\u200b" * 20000 + "visible " * 600,          # a sea of removed characters
    "\u200b" * 5000 + "short tail",                # window grows past invisible text
    "How do I reset my password?" + " \n" * 20000,  # a question, then a sea of blank lines
])
def test_windowed_tokenizing_equals_tokenizing_everything(tokenizer, text):
    assert encode_tail(tokenizer, text, 256) == full_text_ids(tokenizer, text)


@pytest.mark.parametrize("text", ["", "   ", "\u200b\u200f\ufeff", "\x00\x01", "😀", "🍕 🍣"])
def test_texts_with_nothing_to_embed(tokenizer, text):
    with pytest.raises(NothingToEmbed):
        encode_tail(tokenizer, text, 256)


def test_megabyte_texts_are_cheap(tokenizer):
    import time
    for text in ("a" * 1_000_000, "中文" * 500_000, "hello world " * 90_000, "😀" * 500_000):
        started = time.perf_counter()
        try:
            encode_tail(tokenizer, text, 256)
        except NothingToEmbed:
            pass
        assert time.perf_counter() - started < 0.5


# --- plan_batches ---------------------------------------------------------------------

def test_plan_covers_every_text_once_within_max_batch():
    lengths = [5, 60, 7, 33, 9, 120, 12, 6, 64, 8, 30, 5]
    runs = plan_batches(lengths, max_batch=4, run_overhead_tokens=8)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    assert all(1 <= len(run) <= 4 for run in runs)


def test_plan_groups_similar_lengths():
    lengths = [10, 200, 11, 12, 210, 9]
    # Padding 200 to 210 costs 10 token-times, less than a second run (20).
    runs = plan_batches(lengths, max_batch=32, run_overhead_tokens=20)
    assert sorted(sorted(lengths[i] for i in run) for run in runs) == [[9, 10, 11, 12], [200, 210]]


def test_plan_runs_go_in_order_of_their_oldest_text():
    # Index = arrival order. The long text came first: its run goes first.
    lengths = [200, 10, 11, 210, 12]
    runs = plan_batches(lengths, max_batch=32, run_overhead_tokens=20)
    assert runs == [[0, 3], [1, 2, 4]]
    assert [min(run) for run in plan_batches([5, 90, 6, 91, 7, 92], 2, 1)] == sorted(
        min(run) for run in plan_batches([5, 90, 6, 91, 7, 92], 2, 1))


def test_plan_with_a_dear_run_makes_one_batch_and_with_a_free_run_no_padding():
    lengths = [10, 200, 11, 12]
    assert len(plan_batches(lengths, max_batch=32, run_overhead_tokens=10_000)) == 1
    runs = plan_batches(lengths, max_batch=32, run_overhead_tokens=0)
    assert all(len({lengths[i] for i in run}) == 1 for run in runs)


@pytest.mark.parametrize("lengths, expected", [([], []), ([7], [[0]])])
def test_plan_edges(lengths, expected):
    assert plan_batches(lengths, 8, 8) == expected


# --- tensors --------------------------------------------------------------------------

def test_padding_does_not_change_the_pooled_vector():
    rng = np.random.default_rng(0)
    ids, mask = pad_batch([[1, 2, 3], [1, 2, 3, 4, 5]])
    assert ids.tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]] and mask.sum() == 8
    hidden = rng.standard_normal((2, 5, 4)).astype(np.float32)
    pooled = mean_pool_normalize(hidden, mask)
    alone = mean_pool_normalize(hidden[:1, :3], mask[:1, :3])
    np.testing.assert_allclose(pooled[0], alone[0], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(pooled, axis=1), 1.0, atol=1e-6)


# --- settings -------------------------------------------------------------------------

def test_default_settings_are_valid():
    settings = EmbeddingSettings()
    assert settings.provider == "auto" and settings.max_tokens == 256


def test_max_batch_zero_means_the_providers_default():
    assert EmbeddingSettings().batch_ceiling(on_gpu=False) == 32
    assert EmbeddingSettings().batch_ceiling(on_gpu=True) == 128
    assert EmbeddingSettings(max_batch=16).batch_ceiling(on_gpu=True) == 16


def test_workers_zero_means_two_on_a_cpu_and_one_on_a_gpu():
    assert EmbeddingSettings().worker_count(on_gpu=False) == 2
    assert EmbeddingSettings().worker_count(on_gpu=True) == 1
    assert EmbeddingSettings(workers=3).worker_count(on_gpu=True) == 3


@pytest.mark.parametrize("field, value", [
    ("provider", "tpu"), ("intra_op_threads", -1), ("max_batch", -1), ("max_batch", 2.5),
    ("max_wait_ms", -1), ("max_wait_ms", float("nan")), ("max_queue", 0), ("max_tokens", 2),
    ("max_tokens", 513), ("model_sha256", "xyz"), ("max_batch", True), ("workers", -1),
])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        EmbeddingSettings(**{field: value})


def test_own_model_needs_its_checksum():
    with pytest.raises(ConfigError, match="model_sha256"):
        EmbeddingSettings(model_path="/models/x.onnx")


def test_from_env():
    env = {"SLUICE_EMBED_PROVIDER": "CPU", "SLUICE_EMBED_MAX_BATCH": "64",
           "SLUICE_EMBED_MAX_WAIT_MS": "2.5", "SLUICE_EMBED_MODEL_PATH": "/m.onnx",
           "SLUICE_EMBED_MODEL_SHA256": "AB" * 32, "OTHER": "ignored"}
    settings = EmbeddingSettings.from_env(env, max_queue=10)
    assert (settings.provider, settings.max_batch, settings.max_wait_ms, settings.max_queue) == \
        ("cpu", 64, 2.5, 10)
    assert settings.model_sha256 == "ab" * 32


def test_from_env_names_the_bad_variable():
    with pytest.raises(ConfigError, match="SLUICE_EMBED_MAX_QUEUE"):
        EmbeddingSettings.from_env({"SLUICE_EMBED_MAX_QUEUE": "many"})


# --- GPU batch limit ------------------------------------------------------------------

@pytest.mark.parametrize("free, tokens, ceiling, expected", [
    (None, 256, 128, 128),                          # no NVML: the fixed maximum
    (0, 256, 128, 1),                               # never below one text
    (80 * 2**30, 256, 128, 128),                    # plenty: the ceiling
    (2 * 64 * BYTES_PER_TOKEN * 256, 256, 128, 64),  # half of free memory, 64 texts
    (2 * 64 * BYTES_PER_TOKEN * 256, 16, 128, 128),  # short texts fit more
])
def test_batch_limit_for_memory(free, tokens, ceiling, expected):
    assert batch_limit_for_memory(free, tokens, ceiling) == expected


# --- provider choice ------------------------------------------------------------------

@pytest.mark.parametrize("setting, available, expected", [
    ("cpu", ["CUDAExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]),
    ("auto", ["CPUExecutionProvider"], ["CPUExecutionProvider"]),
    ("auto", ["CUDAExecutionProvider", "CPUExecutionProvider"],
     ["CUDAExecutionProvider", "CPUExecutionProvider"]),
    ("cuda", ["CUDAExecutionProvider", "CPUExecutionProvider"],
     ["CUDAExecutionProvider", "CPUExecutionProvider"]),
])
def test_choose_providers(setting, available, expected):
    from sidecar.embedding.runtime import choose_providers
    assert choose_providers(setting, available) == expected


def test_cuda_without_onnxruntime_gpu_fails_the_load_clearly():
    from sidecar.embedding.errors import ModelLoadError
    from sidecar.embedding.runtime import choose_providers
    with pytest.raises(ModelLoadError, match="onnxruntime-gpu"):
        choose_providers("cuda", ["CPUExecutionProvider"])


def test_the_ascii_fast_path_normalises_exactly_as_the_general_one():
    import random

    from sidecar.embedding import normalize
    rng = random.Random(3)
    alphabet = [chr(c) for c in range(0x80)] + ["\r\n"] * 5 + [" "] * 20

    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        # the general path's steps, spelled out
        expected = unicodedata.normalize("NFKC", _REMOVED.sub("", normalize._LINE_BREAKS.sub("\n", text))).strip()
        assert normalize_text(text) == expected, repr(text)
