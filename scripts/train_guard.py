"""Trains the prompt-injection classifier (sidecar/guard/injection_head.npz).

    .venv/bin/python scripts/train_guard.py

Data and splits: bench/guard_data.py. One logistic model over the prompt's MiniLM embedding and
its hashed character n-grams (sidecar/guard/lexical.py), trained jointly by full-batch Adam with
L2 (stronger on the embedding's 384 dense weights than on the sparse n-gram ones) and class
weights (attacks are few); the epoch count is chosen on the val split by recall at low
false-alarm rates. A second logistic over the n-grams alone, trained the same way on every
prompt (those the model cannot embed included), judges prompts without an embedding, and the
last paragraph of a prompt of several (the higher of its score and the full model's). The scores
of the ordinary val prompts (paraphrase set, data/guard/ordinary.jsonl) under each model are saved with the weights: they turn
a route's false-alarm rate into a threshold per model. The test splits are not read. Deterministic: the same data
gives the same weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.guard_data import ORDINARY_SOURCES, embed_all, injection_examples  # noqa: E402
from sidecar.guard import lexical  # noqa: E402
from sidecar.guard.injection import WEIGHTS, InjectionHead, TextHead  # noqa: E402

EPOCHS, LR, L2_LEXICAL, L2_EMBEDDING = 600, 0.02, 1e-5, 1e-4
# The share of the benign training weight the ordinary non-English prompts carry (by count they
# are ~2%, and the models flagged them far more often than English ones): chosen on validation
# among shares fixed beforehand (scripts/exp_guard_calibration.py, docs/guard-quality.md).
NON_ENGLISH_SHARE = 0.25


class Ngrams:
    """The n-gram features of many texts as a sparse matrix (rows, buckets, values)."""

    def __init__(self, texts: list[str], buckets=lexical.buckets, dim: int = lexical.DIM):
        self.dim = dim                  # the table size: buckets are below it
        rows, cols, values = [], [], []
        for i, text in enumerate(texts):
            index = buckets(text)
            rows.append(np.full(len(index), i))
            cols.append(index)
            values.append(np.full(len(index), 1 / np.sqrt(max(1, len(index)))))
        self.rows, self.cols, self.values = (np.concatenate(a) for a in (rows, cols, values))
        self.n = len(texts)

    def dot(self, weights: np.ndarray) -> np.ndarray:       # X @ w
        return np.bincount(self.rows, weights=self.values * weights[self.cols], minlength=self.n)

    def grad(self, g: np.ndarray) -> np.ndarray:            # X.T @ g
        return np.bincount(self.cols, weights=self.values * g[self.rows], minlength=self.dim)


def recall_at(scores: np.ndarray, labels: np.ndarray, rate: float) -> float:
    benign = np.sort(scores[labels == 0])
    threshold = benign[min(len(benign) - 1, int(np.ceil(len(benign) * (1 - rate))))]
    return float((scores[labels == 1] > threshold).mean())


def logits(params: dict, vectors: np.ndarray, ngrams: Ngrams) -> np.ndarray:
    z = vectors @ params["embedding"] + ngrams.dot(params["lexical"]) + params["bias"]
    if "hidden" in params:
        z = z + np.maximum(vectors @ params["hidden"] + params["hidden_bias"], 0) @ params["out"]
    return z


def class_weights(y, train_rows) -> np.ndarray:
    """Attacks and benign prompts weigh half each (attacks are few); val rows weigh 0."""
    yt = y[train_rows]
    return np.where(y == 1, 0.5 / yt.mean(), 0.5 / (1 - yt.mean())) * train_rows / train_rows.sum()


def sample_weights(examples, y, train_rows, non_english_share: float | None = None) -> np.ndarray:
    """class_weights, with the ordinary non-English train prompts (data/guard/ordinary.jsonl,
    source "ordinary") carrying `non_english_share` of the benign weight and the other benign
    prompts the rest, each group by count within (None: every benign prompt by count)."""
    weight = class_weights(y, train_rows)
    if non_english_share is None:
        return weight
    own = np.array([e.source == "ordinary" for e in examples]) & train_rows
    rest = (y == 0) & train_rows & ~own
    benign = weight[own | rest].sum()
    weight[own] = benign * non_english_share / own.sum()
    weight[rest] *= benign * (1 - non_english_share) / weight[rest].sum()
    return weight


def _init(vectors, ngrams: Ngrams, hidden: int) -> dict:
    params = {"embedding": np.zeros(vectors.shape[1]), "lexical": np.zeros(ngrams.dim), "bias": np.zeros(())}
    if hidden:
        # A small ReLU layer over the embedding beside the linear terms (seeded: deterministic).
        rng = np.random.default_rng(22)
        params.update(hidden=rng.normal(0, 1 / np.sqrt(vectors.shape[1]), (vectors.shape[1], hidden)),
                      hidden_bias=np.zeros(hidden), out=np.zeros(hidden))
    return params


def _grads(params, vectors, ngrams, g) -> dict:
    grads = {"embedding": vectors.T @ g, "lexical": ngrams.grad(g), "bias": g.sum()}
    if "hidden" in params:
        h = np.maximum(vectors @ params["hidden"] + params["hidden_bias"], 0)
        dh = np.outer(g, params["out"]) * (h > 0)
        grads.update(out=h.T @ g, hidden=vectors.T @ dh, hidden_bias=dh.sum(axis=0))
    return grads


def train(vectors, ngrams, y, train_rows, val_rows, weight=None, l2_embedding=L2_EMBEDDING, l2_lexical=L2_LEXICAL,
          hidden: int = 0):
    l2 = {"embedding": l2_embedding, "lexical": l2_lexical, "bias": 0.0,
          "hidden": l2_embedding, "hidden_bias": 0.0, "out": l2_embedding}
    if weight is None:
        weight = class_weights(y, train_rows)

    def forward(params):
        return logits(params, vectors, ngrams), lambda g: _grads(params, vectors, ngrams, g)

    best_params, _, best_epoch, best = fit(_init(vectors, ngrams, hidden), l2, forward, y, weight, val_rows)
    return best_params, best_epoch, best


def fit(params: dict, l2: dict, forward, y, weight, val_rows) -> tuple[dict, np.ndarray, int, float]:
    """Full-batch Adam on the weighted logistic loss, EPOCHS epochs from `params` (updated in
    place), each weight with its `l2`; every 20th epoch is judged on `val_rows` by the mean recall
    at low false-alarm rates. forward(params) -> (every row's logit, a function from d loss /
    d logit to each weight's gradient). Returns the best judged epoch's weights (after its step),
    logits (before it), the epoch and its quality."""
    moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in params.items()}
    best, best_params, best_z, best_epoch = -1.0, None, None, 0
    for epoch in range(1, EPOCHS + 1):
        z, gradients = forward(params)
        grads = gradients((1 / (1 + np.exp(-z)) - y) * weight)     # d loss / d logit
        for k in params:
            grad = grads[k] + l2[k] * params[k]
            m, v = moments[k]
            m[...] = 0.9 * m + 0.1 * grad
            v[...] = 0.999 * v + 0.001 * grad ** 2
            params[k] = params[k] - LR * (m / (1 - 0.9 ** epoch)) / (np.sqrt(v / (1 - 0.999 ** epoch)) + 1e-8)
        if epoch % 20 == 0:
            sv = z[val_rows]
            quality = np.mean([recall_at(sv, y[val_rows], r) for r in (0.001, 0.005, 0.01, 0.02)])
            if quality > best:
                best, best_params, best_z, best_epoch = quality, {k: v.copy() for k, v in params.items()}, z, epoch
    return best_params, best_z, best_epoch, best


def calibration_groups(examples) -> np.ndarray:
    """Each ordinary prompt's calibration group: its source's place in ORDINARY_SOURCES (the
    English paraphrase prompts; the ordinary prompts in other languages)."""
    return np.array([ORDINARY_SOURCES.index(e.source) for e in examples], np.int8)


def train_text_head(examples, non_english_share: float | None = NON_ENGLISH_SHARE) -> TextHead:
    """The n-gram model for prompts without an embedding, on every train prompt."""
    ngrams = Ngrams([e.text for e in examples])
    y = np.array([e.label for e in examples], np.float64)
    is_train = np.array([e.split == "train" for e in examples])
    params, epoch, quality = train(np.zeros((len(examples), 0)), ngrams, y, is_train, ~is_train,
                                   sample_weights(examples, y, is_train, non_english_share))
    # The weights as the head file stores them (float16 n-gram weights, a float32 bias): the
    # calibration scores must be those the sidecar computes, or a threshold misses its rate.
    head = TextHead(params["lexical"].astype(np.float16).astype(np.float32), float(np.float32(params["bias"])),
                    np.zeros(0, np.float32))
    val = [e for e, t in zip(examples, is_train) if not t]
    sv = np.array([head.score(e.text) for e in val])
    ordinary = np.array([e.source in ORDINARY_SOURCES for e in val])
    print(f"n-gram model: best epoch {epoch}; val recall at 0.1/0.5/1/2% false alarms (mean) {quality:.3f}; "
          f"at 1%: {recall_at(sv, y[~is_train], 0.01):.3f}")
    calibrating = [e for e, o in zip(val, ordinary) if o]
    return TextHead(head.lexical, head.bias, sv[ordinary].astype(np.float32), calibration_groups(calibrating))


def main() -> int:
    examples = [e for e in injection_examples() if e.split != "test"]
    print(f"embedding {len(examples)} train and val prompts (cached in build/guard/)")
    vectors = embed_all([e.text for e in examples])
    usable = ~np.isnan(vectors).any(axis=1)
    text_head = train_text_head(examples)
    print(f"{int((~usable).sum())} prompts the model does not embed (too many unknown tokens): "
          "left out of the full model")
    examples = [e for e, ok in zip(examples, usable) if ok]
    vectors = vectors[usable].astype(np.float64)
    ngrams = Ngrams([e.text for e in examples])
    y = np.array([e.label for e in examples], np.float64)
    is_train = np.array([e.split == "train" for e in examples])
    print(f"train: {int(y[is_train].sum())} attacks, {int((1 - y[is_train]).sum())} benign; "
          f"val: {int(y[~is_train].sum())} attacks, {int((1 - y[~is_train]).sum())} benign")
    params, epoch, quality = train(vectors, ngrams, y, is_train, ~is_train,
                                   sample_weights(examples, y, is_train, NON_ENGLISH_SHARE))
    # A prompt of several paragraphs also scores as its last one read by the n-gram model
    # (scripts/exp_guard_tail.py: orders appended to documents, on validation).
    head = InjectionHead(params["embedding"].astype(np.float32), params["lexical"].astype(np.float32),
                         float(params["bias"]), np.zeros(0, np.float32), text_head, last_paragraph=True)
    # Scores as the sidecar computes them (float16 weights, one prompt at a time).
    head.save(WEIGHTS)
    head = InjectionHead.load(WEIGHTS)
    val = [(v, e) for v, e, t in zip(vectors, examples, is_train) if not t]
    sv = np.array([head.score(v.astype(np.float32), e.text) for v, e in val])
    yv = y[~is_train]
    # A route's false_alarm_rate is a share of ordinary prompts: the threshold comes from the
    # ordinary validation prompts only, not the look-alikes written to be hard, and holds in
    # each group of them.
    ordinary = np.array([e.source in ORDINARY_SOURCES for _, e in val])
    groups = calibration_groups([e for (_, e), o in zip(val, ordinary) if o])
    head = InjectionHead(head.embedding, head.lexical, head.bias, sv[ordinary].astype(np.float32), head.text, groups,
                         head.last_paragraph)
    head.save(WEIGHTS)
    with np.load(WEIGHTS) as data:      # the head's loader reads them as the file orders them
        assert all((np.diff(data[f"{p}benign_scores"]) >= 0).all() for p in ("", "text_")), "calibration not ascending"
    print(f"best epoch {epoch}; val recall at 0.1/0.5/1/2% false alarms (mean) {quality:.3f}; "
          f"at 1%: {recall_at(sv, yv, 0.01):.3f}")
    print(f"wrote {WEIGHTS.relative_to(ROOT)} ({WEIGHTS.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
