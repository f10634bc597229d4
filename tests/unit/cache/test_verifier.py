"""The semantic verifier: its model, its features, and how same_question uses it."""
import dataclasses
import json

import numpy as np
import pytest

from sidecar.cache.alignment import ALIGN_FEATURES, STATES_LAYERS
from sidecar.cache.equivalence import EquivalenceSettings, Verdict, disagreements
from sidecar.cache.same_question import candidate_floor, same_question
from sidecar.cache.policy import CachePolicy
from sidecar.cache.verifier import FEATURES, MODEL_PATH, Calibration, NoStates, Verifier, features, load_verifier

ON = EquivalenceSettings(max_false_hit_rate=0.01)
OFF = EquivalenceSettings(max_false_hit_rate=0.0)      # the lexical decision


@pytest.fixture(scope="module")
def encoder():
    from sidecar.embedding import EmbeddingSettings
    from sidecar.embedding.loader import load
    return load(EmbeddingSettings(provider="cpu")).encoder


def verdict(encoder, a, b, settings):
    """same_question with the prompts' cosine and token states from the served engine, as the
    sidecar has them (a made-up cosine with real states is a pair the model never sees)."""
    (va, vb), (sa, sb) = encoder.run_with_states([encoder.tokenize(a), encoder.tokenize(b)])
    return same_question(a, b, float(va @ vb), settings, layer_states=(sa, sb))


def test_the_shipped_model_matches_the_code_and_its_budget():
    model = json.loads(MODEL_PATH.read_text())
    assert tuple(model["features"]) == FEATURES + ALIGN_FEATURES
    assert model["states_layers"] == STATES_LAYERS
    assert load_verifier().needs_states
    assert MODEL_PATH.stat().st_size < 5 * 1024 * 1024
    verifier = load_verifier()
    assert 0.0 < verifier.floor < 0.93
    thresholds = verifier.calibration.thresholds
    # A stricter target never gets a looser threshold.
    assert list(thresholds) == sorted(thresholds, reverse=True)


def test_trees_route_on_their_splits():
    # One tree of depth 1: feature 0 (cosine) > 0.5 goes right (+2), else left (-2).
    stump = {"features": list(FEATURES), "base": 0.0, "depth": 1, "floor": 0.5,
             "trees": [{"feature": [0], "split": [0.5], "leaf": [-2.0, 2.0]}],
             "calibration": {"rates": [0.01, 0.05], "thresholds": [0.9, 0.6]}}
    verifier = Verifier(stump)
    x = np.zeros((2, len(FEATURES)))
    x[1, 0] = 0.9
    assert np.allclose(verifier.logits(x), [-2.0, 2.0])
    assert verifier.threshold(0.001) == 0.9 and verifier.threshold(0.02) == 0.9 and verifier.threshold(0.5) == 0.6
    with pytest.raises(ValueError, match="features"):
        Verifier({**stump, "features": ["cosine"]})


def test_a_model_whose_features_this_code_cannot_compute_is_refused_at_load():
    stump = {"features": list(FEATURES), "base": 0.0, "depth": 1, "floor": 0.5,
             "trees": [{"feature": [0], "split": [0.5], "leaf": [-2.0, 2.0]}],
             "calibration": {"rates": [0.01], "thresholds": [0.9]}}
    assert not Verifier(stump).needs_states
    aligned = {**stump, "features": list(FEATURES + ALIGN_FEATURES), "states_layers": STATES_LAYERS}
    assert Verifier(aligned).needs_states
    # Trained on another layer's states (or on states of no layer recorded): refused.
    with pytest.raises(ValueError, match="after layer 2"):
        Verifier({**aligned, "states_layers": 2})
    with pytest.raises(ValueError, match="after layer None"):
        Verifier({**stump, "features": list(FEATURES + ALIGN_FEATURES)})
    with pytest.raises(ValueError, match="unknown: cross_attention"):
        Verifier({**stump, "features": list(FEATURES) + ["cross_attention"]})
    with pytest.raises(ValueError, match="order or subset"):
        Verifier({**stump, "features": list(ALIGN_FEATURES + FEATURES)})


def test_a_verifier_that_reads_token_states_never_decides_without_them(encoder):
    verifier = load_verifier()
    a, b = "How do I reset my password?", "How can I reset my password?"
    with pytest.raises(NoStates):
        verifier.row(a, b, 0.99)
    _, (sa, sb) = encoder.run_with_states([encoder.tokenize(a), encoder.tokenize(b)])
    with pytest.raises(NoStates):
        verifier.row(a, b, 0.99, states=(sa, None))
    assert verifier.row(a, b, 0.99, states=(sa, sb)).shape == (len(FEATURES) + len(ALIGN_FEATURES),)
    for states in (None, (None, sb), (sa, None)):
        missing = same_question(a, b, 0.99, ON, layer_states=states)
        assert not missing.hit and missing.reason == "verifier_no_states" and missing.score is None


def test_calibration_never_looser_than_asked():
    cal = Calibration((0.005, 0.01, 0.05), (0.95, 0.9, 0.7))
    assert cal.threshold(0.0001) == 0.95
    assert cal.threshold(0.01) == 0.9
    assert cal.threshold(0.049) == 0.9


def test_features_are_symmetric_and_see_what_cosine_cannot():
    a, b = "Is every square a rectangle?", "Is every rectangle a square?"
    fa, fb = features(a, b, 0.98), features(b, a, 0.98)
    assert np.array_equal(fa, fb)
    named = dict(zip(FEATURES, fa))
    assert named["exchanged"] == 1 and named["cosine"] == 0.98
    opposite = dict(zip(FEATURES, features("¿Cuál es el mejor portátil?", "¿Cuál es el peor portátil?", 0.97)))
    assert opposite["opposite_words"] == 1


def test_same_question_with_the_verifier(encoder):
    rewording = ("How do I reset my password?", "How can I reset my password?")
    found = verdict(encoder, *rewording, ON)
    assert 0.0 <= found.score <= 1.0
    assert found.hit == (found.score >= load_verifier().threshold(0.01))
    assert found.reason == ("ok" if found.hit else "verifier_rejected")
    near_miss = ("How do I make a cup of green tea?", "How do I make a cup of black tea?")
    other = verdict(encoder, *near_miss, ON)
    assert not other.hit and other.score < found.score
    assert same_question(*rewording, 0.99, OFF).score is None     # off: no score
    floor = load_verifier().floor
    below = same_question(*rewording, floor - 0.01, ON)
    assert not below.hit and below.reason == "below_threshold" and below.score is None
    # A check kept as a veto says no before the model is asked.
    vetoed = same_question("Set a timer for 20 minutes", "Set a timer for 25 minutes", 0.99,
                           dataclasses.replace(ON, verifier_vetoes=("numbers",)))
    assert not vetoed.hit and vetoed.reason == "numbers_differ" and vetoed.score is None
    # A stricter rate never serves what a looser one refuses.
    for a, b in (rewording, near_miss, ("Can you explain what a black hole is?", "Explain what a black hole is.")):
        strict = verdict(encoder, a, b, dataclasses.replace(ON, max_false_hit_rate=0.002))
        loose = verdict(encoder, a, b, dataclasses.replace(ON, max_false_hit_rate=0.1))
        assert loose.hit or not strict.hit
    assert candidate_floor(ON) == floor and candidate_floor(OFF) == 0.93


def test_case_matters_only_where_the_prompt_uses_case():
    assert disagreements("Is Polish hard to learn?", "Is polish hard to learn?").case
    assert not disagreements("is polish hard to learn", "Is Polish hard to learn?").case     # typed in lower case
    assert not disagreements("Best Laptop For Students", "Best laptop for students").case      # Title Case
    case = EquivalenceSettings(check_case=True, max_false_hit_rate=0.0)
    verdict = same_question("Is Polish hard to learn?", "Is polish hard to learn?", 1.0, case)
    assert not verdict.hit and verdict.reason == "case_differs"
    # Off by default (measured: on the paraphrase pairs it loses correct hits only).
    assert same_question("Is Polish hard to learn?", "Is polish hard to learn?", 1.0, OFF).hit


def test_settings_refuse_bad_rates_and_vetoes():
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="max_false_hit_rate"):
            EquivalenceSettings(max_false_hit_rate=bad)
        with pytest.raises(ValueError, match="max_false_hit_rate"):
            CachePolicy(max_false_hit_rate=bad)
    with pytest.raises(ValueError, match="verifier_vetoes"):
        EquivalenceSettings(verifier_vetoes=("spelling",))


def test_the_default_is_the_verifier_at_a_five_percent_false_hit_rate(encoder):
    default = EquivalenceSettings()
    assert CachePolicy().max_false_hit_rate == default.max_false_hit_rate == 0.05
    assert candidate_floor(default) == load_verifier().floor
    found = verdict(encoder, "How do I reset my password?", "What are the steps to reset my password?", default)
    assert found.hit and found.score >= load_verifier().threshold(0.05)
    assert not verdict(encoder, "How do I make a cup of green tea?", "How do I make a cup of black tea?", default).hit


def test_prompts_naming_different_identifiers_never_share_an_answer(encoder):
    # The verifier alone serves this pair at the default (score 0.90): its training pairs have
    # no identifiers.
    a, b = "no trace 079eeded81ce4c19841f51197d0b7bea", "trace me 607016e4b05c4a6ea709e98e1af2cb0e"
    verifier = load_verifier()
    (va, vb), states = encoder.run_with_states([encoder.tokenize(a), encoder.tokenize(b)])
    score = float(verifier.probabilities(verifier.row(a, b, float(va @ vb), states=states))[0])
    assert score >= verifier.threshold(0.05)
    default = EquivalenceSettings()
    assert verdict(encoder, a, b, default) == Verdict(False, "identifiers_differ")
    for settings in (default, OFF):
        assert same_question(a, b, 0.99, settings).reason == "identifiers_differ"
        assert same_question("status of order INV-2024-0042", "status of order INV-2024-0043", 0.99,
                             settings).reason == "identifiers_differ"
        assert same_question("status of order 48213377", "what is the status of my order", 0.99,
                             settings).reason == "identifiers_differ"
    # The same identifier, written with or without separators and case, is no difference ...
    for x, y in (("what is SHA-256", "what is sha256"), ("RTX 4090 price", "rtx4090 price"),
                 ("order INV-2024-0042 is late", "why is inv 2024 0042 late")):
        assert same_question(x, y, 0.99, default).reason != "identifiers_differ"
    # ... and numbers written into words are not identifiers.
    for x, y in (("I work 12-hour night shifts", "I work twelve-hour night shifts"),
                 ("Is a 10-year-old fridge worth fixing?", "Is a fridge that is ten years old worth fixing?"),
                 ("COVID-19 symptoms", "symptoms of covid"),
                 ("best earphones under 2000INR", "best earphones under Rs. 2000"),
                 ("I have lived 26years with my mother", "I have lived with my mother for 26 years")):
        assert same_question(x, y, 0.99, default).reason != "identifiers_differ"
