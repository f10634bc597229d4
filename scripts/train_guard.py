"""Trains the prompt-injection head (sidecar/guard/injection_head.npz) over MiniLM embeddings.

    .venv/bin/python scripts/train_guard.py

Data and splits: bench/guard_data.py. A one-hidden-layer MLP (32 ReLU units, logistic output),
full-batch Adam with L2 and class weights (attacks are few), the epoch count chosen on the val
split by average precision at low false-alarm rates. Benign val scores are saved with the
weights: they turn a route's false-alarm rate into a threshold. The test splits are not read.
Seeded: the same data gives the same weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.guard_data import embed_all, injection_examples  # noqa: E402

OUT = ROOT / "sidecar" / "guard" / "injection_head.npz"
HIDDEN, EPOCHS, LR, L2 = 32, 600, 0.003, 1e-4


def recall_at(scores: np.ndarray, labels: np.ndarray, rate: float) -> float:
    benign = np.sort(scores[labels == 0])
    threshold = benign[min(len(benign) - 1, int(np.ceil(len(benign) * (1 - rate))))]
    return float((scores[labels == 1] > threshold).mean())


def train(x: np.ndarray, y: np.ndarray, xv: np.ndarray, yv: np.ndarray, seed: int = 22):
    rng = np.random.default_rng(seed)
    dim = x.shape[1]
    params = {"w1": rng.normal(0, 1 / np.sqrt(dim), (dim, HIDDEN)).astype(np.float32),
              "b1": np.zeros(HIDDEN, np.float32),
              "w2": rng.normal(0, 1 / np.sqrt(HIDDEN), HIDDEN).astype(np.float32),
              "b2": np.zeros((), np.float32)}
    moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in params.items()}
    weight = np.where(y == 1, 0.5 / y.mean(), 0.5 / (1 - y.mean())).astype(np.float32)
    best, best_params, best_epoch = -1.0, None, 0
    for epoch in range(1, EPOCHS + 1):
        h = np.maximum(x @ params["w1"] + params["b1"], 0)
        p = 1 / (1 + np.exp(-(h @ params["w2"] + params["b2"])))
        g = (p - y) * weight / len(y)                      # d loss / d logit
        grads = {"w2": h.T @ g + L2 * params["w2"], "b2": g.sum()}
        gh = np.outer(g, params["w2"]) * (h > 0)
        grads["w1"] = x.T @ gh + L2 * params["w1"]
        grads["b1"] = gh.sum(0)
        for k in params:
            m, v = moments[k]
            m[...] = 0.9 * m + 0.1 * grads[k]
            v[...] = 0.999 * v + 0.001 * grads[k] ** 2
            params[k] = params[k] - LR * (m / (1 - 0.9 ** epoch)) / (np.sqrt(v / (1 - 0.999 ** epoch)) + 1e-8)
        if epoch % 20 == 0:
            sv = scores(params, xv)
            quality = np.mean([recall_at(sv, yv, r) for r in (0.005, 0.01, 0.02)])
            if quality > best:
                best, best_params, best_epoch = quality, {k: v.copy() for k, v in params.items()}, epoch
    return best_params, best_epoch, best


def scores(params, x):
    h = np.maximum(x @ params["w1"] + params["b1"], 0)
    return 1 / (1 + np.exp(-(h @ params["w2"] + params["b2"])))


def main() -> int:
    examples = [e for e in injection_examples() if e.split != "test"]
    print(f"embedding {len(examples)} train and val prompts (cached in build/guard/)")
    vectors = embed_all([e.text for e in examples])
    usable = ~np.isnan(vectors).any(axis=1)
    print(f"{int((~usable).sum())} prompts the model does not embed (too many unknown tokens): left out")
    examples = [e for e, ok in zip(examples, usable) if ok]
    vectors = vectors[usable]
    labels = np.array([e.label for e in examples], np.float32)
    is_train = np.array([e.split == "train" for e in examples])
    x, y, xv, yv = vectors[is_train], labels[is_train], vectors[~is_train], labels[~is_train]
    print(f"train: {int(y.sum())} attacks, {int((1 - y).sum())} benign; val: {int(yv.sum())} attacks, {int((1 - yv).sum())} benign")
    params, epoch, quality = train(x, y, xv, yv)
    sv = scores(params, xv)
    print(f"best epoch {epoch}; val recall at 0.5/1/2% false alarms (mean) {quality:.3f}; "
          f"at 1%: {recall_at(sv, yv, 0.01):.3f}")
    np.savez_compressed(OUT, **{k: v.astype(np.float16) if v.ndim else v for k, v in params.items()},
                        benign_scores=np.sort(sv[yv == 0]).astype(np.float32))
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
