"""scripts/train_crossenc.py: the numpy scoring of one pair (what serving would run) gives the jax
model's score, padded in a batch, and either order of the texts gives the same score."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")            # the verifier-train extra
jnp = pytest.importorskip("jax.numpy")

from scripts import train_crossenc as tc  # noqa: E402


def test_numpy_pair_score_matches_the_batched_jax_model_and_is_symmetric():
    rng = np.random.default_rng(0)
    params = tc.init_params(4)
    # Every head input live, so a wrong mask, segment or alignment term shows in the score.
    params.update(w_prod=rng.normal(size=384).astype(np.float32), w_diff=rng.normal(size=384).astype(np.float32),
                  w_align=np.array([3.0, -2.0, 4.0, -1.0], np.float32), a_emb=np.float32(2.0),
                  cross=rng.normal(size=params["cross"].shape).astype(np.float32))
    texts = {f"t{n}": rng.normal(size=(n, 384)).astype(np.float16) for n in (5, 9, 14, 80)}
    pairs = [{"a": "t5", "b": "t9"}, {"a": "t14", "b": "t5"}, {"a": "t9", "b": "t80"}]
    cos = np.array([0.7, 0.8, 0.9], np.float32)
    logits_fn, _ = tc.make_fns(jax, jnp)
    batched = tc.scores(jax.tree_util.tree_map(jnp.asarray, params), logits_fn, pairs, texts, cos)
    for p, c, expected in zip(pairs, cos, batched):
        one = 1 / (1 + np.exp(-tc.score_np(params, texts[p["a"]], texts[p["b"]], c)))
        swapped = 1 / (1 + np.exp(-tc.score_np(params, texts[p["b"]], texts[p["a"]], c)))
        assert abs(one - expected) < 1e-4
        assert abs(one - swapped) < 1e-5
    assert np.ptp(batched) > 0.01            # the pairs are told apart: not a constant head
