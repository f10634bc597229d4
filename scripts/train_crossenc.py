"""Experiment: MiniLM's top layers fine-tuned as a cross-encoder on the pair (DeFormer-style split).

    nice -n 19 .venv/bin/python scripts/train_crossenc.py [--split 4] [--epochs 3]

Each text's token states after MiniLM's first `split` layers (run per text, as the embedder
runs them: scripts/crossenc_states.py) are concatenated; the top 6 - `split` layers, initialised
from MiniLM's own weights, run jointly over both texts, with one learned score bias per head for
attention across the two texts (initialised negative, so at the start each text mostly attends
to itself and the pooled vectors are MiniLM's own: the start is the cosine). A small symmetric
head reads the two texts' mean-pooled states (u*v, |u-v|, their cosine) and the embedder's cosine.
Symmetric by construction: swapping the texts permutes tokens, nothing else.

Trained (jax on CPU, a dev-only dependency: `pip install jax`) only on pairs the project owns, the
training pairs of scripts/train_verifier.py; calibrated as train_verifier.py calibrates the trees
(generated held-out frames, public tune halves); reported on the held-out sets of
scripts/eval_semantic.py next to today's decision and the trees. Writes reports/crossenc.json
and the weights to build/semantic/crossenc-L<split>.npz.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from crossenc_states import DIM, HEADS, experiment_sets, top_weights  # noqa: E402

REPORT = ROOT / "reports" / "crossenc.json"
MAX_TOKENS = 64          # per text in the joint layers: [CLS] and the last 63 states (the end says most)
BUCKETS = (32, 64, 96, 128)
BATCH = 16
CROSS_BIAS0 = -3.0


def clip(states: np.ndarray) -> np.ndarray:
    if len(states) <= MAX_TOKENS:
        return states
    return np.concatenate([states[:1], states[-(MAX_TOKENS - 1):]])


def pack(pairs, states, cos):
    """Pairs -> batches of (x [B,T,384], seg [B,T], mask [B,T], cos [B]) by length bucket, and
    each batch's pair indices. Pairs with a text that has no states are left out (cosine 0)."""
    items = []
    for i, p in enumerate(pairs):
        sa, sb = states.get(p["a"]), states.get(p["b"])
        if sa is None or sb is None or len(sa) == 0 or len(sb) == 0:
            continue
        sa, sb = clip(sa), clip(sb)
        items.append((len(sa) + len(sb), i, sa, sb))
    items.sort(key=lambda t: t[0])
    batches = []
    for first in range(0, len(items), BATCH):
        chunk = items[first:first + BATCH]
        width = next(b for b in BUCKETS if b >= chunk[-1][0])
        x = np.zeros((BATCH, width, DIM), np.float32)
        seg = np.zeros((BATCH, width), np.int32)
        mask = np.zeros((BATCH, width), np.float32)
        c = np.zeros(BATCH, np.float32)
        idx = np.full(BATCH, -1)
        for row, (n, i, sa, sb) in enumerate(chunk):
            x[row, :len(sa)], x[row, len(sa):n] = sa, sb
            seg[row, len(sa):n] = 1
            mask[row, :n] = 1
            c[row], idx[row] = cos[i], i
        batches.append((x, seg, mask, c, idx))
    return batches


def init_params(split: int) -> dict:
    layers = top_weights(split)
    return {"layers": layers,
            "cross": np.full((len(layers), HEADS), CROSS_BIAS0, np.float32),
            "w_prod": np.zeros(DIM, np.float32), "w_diff": np.zeros(DIM, np.float32),
            "a_cos": np.float32(10.0), "a_emb": np.float32(0.0), "b": np.float32(-8.0)}


def make_fns(jax, jnp):
    from jax.scipy.special import erf

    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-12) * g + b

    def layer(x, w, bias):
        B, T, _ = x.shape
        qkv = x @ w["wqkv"] + w["bqkv"]
        q, k, v = (qkv[..., i * DIM:(i + 1) * DIM].reshape(B, T, HEADS, -1).transpose(0, 2, 1, 3) for i in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(DIM // HEADS) + bias
        p = jax.nn.softmax(s, axis=-1)
        ctx = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, DIM)
        h = ln(x + ctx @ w["wo"] + w["bo"], w["g1"], w["b1"])
        f = h @ w["wi"] + w["bi"]
        f = 0.5 * f * (1 + erf(f / np.sqrt(2.0)))
        return ln(h + f @ w["wf"] + w["bf"], w["g2"], w["b2"])

    def logits(params, x, seg, mask, cos):
        other = (seg[:, :, None] != seg[:, None, :]).astype(jnp.float32)[:, None]   # [B,1,T,T]
        pad = (1.0 - mask)[:, None, None, :] * -1e9
        for w, cross in zip(params["layers"], params["cross"]):
            x = layer(x, w, pad + other * cross[None, :, None, None])
        ma = mask * (seg == 0)
        mb = mask * (seg == 1)
        u = (x * ma[..., None]).sum(1) / jnp.maximum(ma.sum(1, keepdims=True), 1)
        v = (x * mb[..., None]).sum(1) / jnp.maximum(mb.sum(1, keepdims=True), 1)
        # Padding rows of a batch pool nothing: a safe norm keeps their (unweighted) loss finite.
        un = u / jnp.sqrt((u * u).sum(-1, keepdims=True) + 1e-12)
        vn = v / jnp.sqrt((v * v).sum(-1, keepdims=True) + 1e-12)
        c = (un * vn).sum(-1)
        return ((un * vn) @ params["w_prod"] + jnp.abs(un - vn) @ params["w_diff"]
                + params["a_cos"] * c + params["a_emb"] * cos + params["b"])

    def loss(params, x, seg, mask, cos, y, weight):
        z = logits(params, x, seg, mask, cos)
        per = jnp.maximum(z, 0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))
        return (per * weight).sum() / jnp.maximum(weight.sum(), 1e-6)

    return jax.jit(logits), jax.jit(jax.value_and_grad(loss))


def train(split: int, epochs: int, lr: float, train_pairs, states, cos, seed: int = 0):
    import jax
    import jax.numpy as jnp
    logits_fn, grad_fn = make_fns(jax, jnp)
    params = jax.tree_util.tree_map(jnp.asarray, init_params(split))
    labels = np.array([p["label"] for p in train_pairs], np.float32)
    weights = np.array([3.0 if "frame" not in p else 1.0 for p in train_pairs], np.float32)
    batches = pack(train_pairs, states, cos)
    steps = epochs * len(batches)
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    rng = np.random.default_rng(seed)
    step = 0
    start = time.perf_counter()
    # The head learns faster than the pretrained layers.
    scale = jax.tree_util.tree_map(lambda _: 1.0, params)
    scale = {**scale, "layers": jax.tree_util.tree_map(lambda _: 0.05, params["layers"])}
    for epoch in range(epochs):
        total = 0.0
        for b in rng.permutation(len(batches)):
            x, seg, mask, c, idx = batches[b]
            ok = idx >= 0
            y = np.where(ok, labels[np.maximum(idx, 0)], 0)
            w = np.where(ok, weights[np.maximum(idx, 0)], 0)
            value, grads = grad_fn(params, x, seg, mask, c, y, w)
            step += 1
            warm = min(1.0, step / (0.1 * steps))
            rate = lr * warm * max(0.0, (steps - step) / steps) ** 0.5
            m = jax.tree_util.tree_map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
            v = jax.tree_util.tree_map(lambda a, g: 0.999 * a + 0.001 * g * g, v, grads)
            c1, c2 = 1 - 0.9 ** step, 1 - 0.999 ** step
            params = jax.tree_util.tree_map(
                lambda p, a, s2, k, c1=c1, c2=c2, r=rate: p - r * k * (a / c1) / (jnp.sqrt(s2 / c2) + 1e-8),
                params, m, v, scale)
            total += float(value)
            if step % 50 == 0:
                print(f"step {step}/{steps}: loss {float(value):.4f} ({time.perf_counter() - start:.0f}s)",
                      file=sys.stderr, flush=True)
        print(f"epoch {epoch + 1}: loss {total / len(batches):.4f} ({time.perf_counter() - start:.0f}s)",
              file=sys.stderr, flush=True)
    return params, logits_fn, time.perf_counter() - start


def scores(params, logits_fn, pairs, states, cos, floor: float = 0.0) -> np.ndarray:
    """P(same question) of each pair; 0 below the cosine floor (never asked) or without states."""
    out = np.zeros(len(pairs))
    asked = [i for i, c in enumerate(cos) if c >= floor]
    for x, seg, mask, c, idx in pack([pairs[i] for i in asked], states, cos[asked]):
        idx = np.array([asked[i] if i >= 0 else -1 for i in idx])
        z = np.asarray(logits_fn(params, x, seg, mask, c))
        ok = idx >= 0
        out[idx[ok]] = 1 / (1 + np.exp(-z[ok]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    from eval_semantic import TODAY, decide, score
    from semantic_vectors import cosines as cosines_of
    from train_verifier import TRAIN_COSINE, calibrate, choose_floor

    from sidecar.cache.equivalence import EquivalenceSettings, disagreements
    train_pairs, calibration, held, states = experiment_sets(args.split)
    cos_of = lambda ps: cosines_of([(p["a"], p["b"]) for p in ps])  # noqa: E731
    c_train = cos_of(train_pairs)
    keep = [p for p, c in zip(train_pairs, c_train) if c >= TRAIN_COSINE]
    params, logits_fn, seconds = train(args.split, args.epochs, args.lr, keep, states,
                                       c_train[c_train >= TRAIN_COSINE])
    cal_cos = {name: cos_of(ps) for name, ps in calibration.items()}
    floor = choose_floor(np.concatenate([c[np.array([p["label"] for p in calibration[name]]) == 1]
                                         for name, c in cal_cos.items()]))
    cal = {name: (scores(params, logits_fn, ps, states, cal_cos[name], floor), cal_cos[name],
                  np.array([p["label"] for p in ps])) for name, ps in calibration.items()}
    calibration_table = calibrate(cal, floor)
    thresholds = dict(zip(calibration_table["rates"], calibration_table["thresholds"]))
    results = {}
    for name, ps in held.items():
        c = cos_of(ps)
        y = np.array([p["label"] for p in ps])
        s = scores(params, logits_fn, ps, states, c, floor)
        symbols = np.array([bool(disagreements(p["a"], p["b"]).symbols) for p in ps])
        rows = {"today": score(y, decide(ps, c, TODAY)[0])}
        for rate in (0.01, 0.02, 0.05):
            trees = dataclasses.replace(EquivalenceSettings(), max_false_hit_rate=rate)
            rows[f"trees {rate:g}"] = score(y, decide(ps, c, trees)[0])
            rows[f"crossenc {rate:g}"] = score(y, (c >= floor) & (s >= thresholds[rate]) & ~symbols)
        results[name] = rows
        print(f"\n{name} ({len(ps)} pairs)")
        for k, r in rows.items():
            print(f"  {k:16s} P {r['precision']} {r['precision_ci']}  R {r['recall']}  hits {r['hits']}")
    flat = {}
    for i, layer in enumerate(params["layers"]):
        flat.update({f"layer{i}.{k}": np.asarray(v) for k, v in layer.items()})
    flat.update({k: np.asarray(params[k]) for k in ("cross", "w_prod", "w_diff", "a_cos", "a_emb", "b")})
    out = ROOT / "build" / "semantic" / f"crossenc-L{args.split}.npz"
    np.savez(out, **flat)
    report = {"split": args.split, "epochs": args.epochs, "lr": args.lr, "train_pairs": len(keep),
              "train_seconds": round(seconds, 1), "floor": floor, "calibration": calibration_table,
              "results": results}
    REPORT.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {REPORT.relative_to(ROOT)}, {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
