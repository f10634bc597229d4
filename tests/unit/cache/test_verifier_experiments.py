"""The verifier experiments' building blocks (docs/semantic-verifier-experiments.md): MiniLM's
top layers rebuilt from the packaged weights, and the token-alignment features."""
import numpy as np

from scripts import crossenc_states, exp_align_features


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
    a = exp_align_features._unit_content(with_cls_sep(tokens))
    b = exp_align_features._unit_content(with_cls_sep(other))
    same = exp_align_features.align_features(a, a)
    changed = exp_align_features.align_features(a, b)
    assert np.allclose(same, 1.0, atol=1e-5)
    assert np.allclose(changed, exp_align_features.align_features(b, a))
    worst_min = exp_align_features.ALIGN.index("align_worst_min")
    assert changed[worst_min] < 0.5 < changed[exp_align_features.ALIGN.index("align_mean_min")]
    assert np.allclose(exp_align_features.align_features(None, a), 0.0)
