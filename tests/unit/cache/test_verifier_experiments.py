"""The verifier experiments' building blocks (docs/semantic-verifier-experiments.md): MiniLM's
top layers rebuilt from the packaged weights, and the token-alignment features."""
import numpy as np

from scripts import crossenc_states
from sidecar.cache.alignment import ALIGN_FEATURES, align_features, unit_tokens


def test_top_layers_from_the_packaged_weights_reproduce_the_model():
    # Layer-4 states, then layers 5 and 6 in numpy from the dequantised weights, against the
    # model's own last hidden states: a wrong weight (q for k, a missing scale) is off by ~1.
    assert crossenc_states.check(4) < 0.01


def test_alignment_features_are_symmetric_and_see_one_unmatched_token():
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(8, 384)).astype(np.float32)
    other = tokens.copy()
    other[4] = rng.normal(size=384)        # one token replaced ("Paris" for "Rome")
    with_cls_sep = lambda x: np.vstack([np.zeros((1, 384)), x, np.zeros((1, 384))])  # noqa: E731
    a = unit_tokens(with_cls_sep(tokens))
    b = unit_tokens(with_cls_sep(other))
    same = align_features(a, a)
    changed = align_features(a, b)
    assert np.allclose(same, 1.0, atol=1e-5)
    assert np.allclose(changed, align_features(b, a))
    worst_min = ALIGN_FEATURES.index("align_worst_min")
    assert changed[worst_min] < 0.5 < changed[ALIGN_FEATURES.index("align_mean_min")]
    assert np.allclose(align_features(None, a), 0.0)
    assert unit_tokens(with_cls_sep(tokens[:0])) is None       # [CLS] [SEP] only: no word piece


def test_the_served_engine_gives_the_states_the_verifier_was_trained_on():
    # Training reads the packaged model's layer-4 output (crossenc_states, fp32 arithmetic);
    # the sidecar reads the served graph's second output (int8 arithmetic) from the run that
    # makes the vector. Their alignment features must agree, or the calibration is off.
    from sidecar.embedding import EmbeddingSettings
    from sidecar.embedding.loader import load
    encoder = load(EmbeddingSettings(provider="cpu")).encoder
    assert encoder.has_states
    texts = ["Is every square a rectangle?", "Is every rectangle a square?",
             "What does a travel agency owe a client?", "¿Cuál es el mejor portátil para estudiantes?"]
    vectors, served = encoder.run_with_states([encoder.tokenize(t) for t in texts])
    assert np.allclose(vectors, encoder.run([encoder.tokenize(t) for t in texts]), atol=1e-6)
    trained = crossenc_states.run_states(texts, 4)
    for text, states in zip(texts, served):
        assert states.dtype == np.float16 and states.shape == trained[text].shape
    for i in range(len(texts)):
        for j in range(len(texts)):
            got = align_features(unit_tokens(served[i]), unit_tokens(served[j]))
            want = align_features(unit_tokens(trained[texts[i]]), unit_tokens(trained[texts[j]]))
            assert np.allclose(got, want, atol=5e-3), (texts[i], texts[j], got, want)


def test_selection_counts_served_pairs_by_kind_and_language_among_candidates_only():
    from scripts import verifier_selection
    pairs = [{"label": 1, "kind": "typo", "lang": "de"}, {"label": 1, "kind": "typo", "lang": "de"},
             {"label": 0, "kind": "scope", "lang": "es"}, {"label": 1, "kind": "typo", "lang": "en"}]
    served = verifier_selection.served_by(pairs, np.array([True, False, True, True]),
                                          np.array([True, True, True, False]))
    # The last pair is under the floor: no decision above it could serve it, so it is not counted.
    assert served == {"0 lang es": "1/1", "0 scope": "1/1", "1 lang de": "1/2", "1 typo": "1/2"}


def test_selection_folds_keep_a_generator_frame_together():
    from scripts import verifier_selection
    frame = {"frame": "en-007", "label": 1}
    assert verifier_selection.fold_of(frame, 0) == verifier_selection.fold_of(dict(frame, label=0), 41)
    folds = {verifier_selection.fold_of({"label": 1, "file": "handwritten.jsonl"}, line) for line in range(200)}
    assert folds == set(range(verifier_selection.FOLDS))
    # Each hand-written file has its own lines: another file's pairs fall in other folds.
    other = [verifier_selection.fold_of({"label": 1, "file": "handwritten-news.jsonl"}, line) for line in range(200)]
    assert other != [verifier_selection.fold_of({"label": 1, "file": "handwritten.jsonl"}, line) for line in range(200)]


def test_monotone_trees_never_rise_against_their_direction():
    from scripts import train_verifier
    from sidecar.cache.verifier import FEATURES, Verifier
    rng = np.random.default_rng(7)
    x = rng.random((3000, len(FEATURES)))
    # The label falls with column 0 on its left half and rises on its right: free trees follow
    # the dip, trees told "rising" in column 0 may not.
    p = np.where(x[:, 0] < 0.5, 0.9 - x[:, 0], x[:, 0]) * 0.6 + 0.4 * x[:, 1]
    y = (rng.random(len(x)) < p).astype(float)
    grid = np.repeat(rng.random((40, len(FEATURES))), 21, axis=0)
    grid[:, 0] = np.tile(np.linspace(0, 1, 21), 40)
    rising = np.zeros(len(FEATURES), int)
    rising[0] = 1

    def steps(direction):
        model = train_verifier.train_trees(x, y, np.ones(len(y)), direction)
        model.update({"features": list(FEATURES), "floor": 0.0, "calibration": {"rates": [1.0], "thresholds": [0.5]}})
        return np.diff(Verifier(model).logits(grid).reshape(40, 21), axis=1)

    assert (steps(rising) >= -1e-9).all()
    assert (steps(None) < -1e-3).any()        # the dip the constraint removes is in the data
    assert train_verifier.directions(["cosine", "words_max", "numbers"]).tolist() == [1, 0, -1]
