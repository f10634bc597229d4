"""Train and calibrate the semantic verifier (sidecar/models/verifier.json).

    .venv/bin/python scripts/train_verifier.py          # writes the model
    .venv/bin/python scripts/train_verifier.py --check  # trains, compares with the shipped model

Training data: only pairs the project owns.
- data/semantic/generator/*.json through scripts/gen_semantic_pairs.py (templates and word
  lists written for this project), the frames of its "train" half;
- HANDWRITTEN: data/semantic/handwritten.jsonl (chat pairs written for this project).  The
  news and caption pairs (handwritten-news.jsonl, handwritten-captions.jsonl) are measured with
  scripts/verifier_selection.py --handwritten and not trained on: on the selection sets they
  lift no public tune half's precision and cost recall on the chat-like ones
  (docs/semantic-verifier-experiments.md, section 5).
Calibration (thresholds only, no weights): the generator's held-out frames ("valid") and the
tune half of ../shared/data/paraphrase (QQP, MRPC, STS-B: measured and tuned on, never
trained on, by their licences).  The hand-written chat test suite (data/semantic/chat-test)
is read by scripts/eval_semantic.py only.

Model: gradient-boosted trees (logistic loss, fixed depth, histogram splits) written here in
numpy, so training is deterministic and needs nothing more than the serving venv; a few
seconds on one core once the embeddings are cached (build/semantic/).  Its inputs: the 23
lexical features and, unless --no-align, the four token-alignment features
(sidecar/cache/alignment.py) of each pair's token states after MiniLM's first four layers
(scripts/crossenc_states.py, cached per text under build/semantic/; the served engine's
states agree with them to a token cosine of 0.9998).  The model file lists its features.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gen_semantic_pairs import generate  # noqa: E402
from sidecar.cache.equivalence import forget_profiles  # noqa: E402
from sidecar.cache.alignment import ALIGN_FEATURES, STATES_LAYERS, align_features, unit_tokens  # noqa: E402
from sidecar.cache.verifier import FEATURES, MODEL_PATH, Verifier, features  # noqa: E402

HANDWRITTEN = (ROOT / "data" / "semantic" / "handwritten.jsonl",)
CACHE = ROOT / "build" / "semantic"

DEPTH = 3
ROUNDS = 300
LEARNING_RATE = 0.08
L2 = 2.0
MIN_HESSIAN = 2.0
BINS = 48
# Pairs below this cosine never reach the verifier: not trained on (the floor is measured below).
TRAIN_COSINE = 0.45
RATES = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1)
# The candidate floor keeps this share of the calibration sets' label-1 pairs.
FLOOR_RECALL = 0.97
# Hand-written pairs count more: there are fewer, and they are the most like traffic.
HANDWRITTEN_WEIGHT = 3.0
# For monotone trees (--monotone): features whose rise may only raise the score; every other
# feature but FREE may only lower it (a disagreement found, content one side lacks).
RISING = frozenset({"cosine", "content_jaccard", "word_jaccard", "trigram_jaccard", "length_ratio",
                    "first_word_same", *ALIGN_FEATURES})
FREE = frozenset({"words_max"})


def load_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def cosines(pairs: list[dict]) -> np.ndarray:
    from semantic_vectors import cosines as cosines_of
    return cosines_of([(p["a"], p["b"]) for p in pairs])


def feature_rows(pairs: list[dict], cos: np.ndarray) -> np.ndarray:
    """Features of every pair, cached on the pairs, cosines and the feature code."""
    code = "".join((ROOT / "sidecar" / f).read_text() for f in
                   ("cache/verifier.py", "cache/equivalence.py", "models/verifier-words.json"))
    key = hashlib.sha256(json.dumps([[p["a"], p["b"]] for p in pairs]).encode()
                         + cos.tobytes() + code.encode()).hexdigest()[:16]
    path = CACHE / f"features-{key}.npy"
    if path.exists():
        return np.load(path)
    start = time.perf_counter()
    rows = np.stack([features(p["a"], p["b"], float(c)) for p, c in zip(pairs, cos)]) if pairs \
        else np.zeros((0, len(FEATURES)))
    print(f"features of {len(pairs)} pairs: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    CACHE.mkdir(parents=True, exist_ok=True)
    np.save(path, rows)
    return rows


def align_rows(pairs: list[dict]) -> np.ndarray:
    """ALIGN_FEATURES of every pair, from its texts' token states (cached per text)."""
    from crossenc_states import token_states
    start = time.perf_counter()
    states = token_states(sorted({t for p in pairs for t in (p["a"], p["b"])}), STATES_LAYERS)
    units = {t: unit_tokens(s) for t, s in states.items()}
    rows = np.stack([align_features(units[p["a"]], units[p["b"]]) for p in pairs]) if pairs \
        else np.zeros((0, len(ALIGN_FEATURES)))
    print(f"alignment of {len(pairs)} pairs: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return rows


# ---------------------------------------------------------------- boosted trees

def _bin_edges(x: np.ndarray) -> list[np.ndarray]:
    edges = []
    for j in range(x.shape[1]):
        values = np.unique(x[:, j])
        if len(values) > BINS:
            values = np.unique(np.quantile(x[:, j], np.linspace(0, 1, BINS + 1)[1:-1], method="lower"))
        # A split "x > edge" between consecutive values.
        edges.append(values[:-1] if len(values) > 1 else values[:0])
    return edges


class _Splits:
    """Every candidate split of every feature, laid out so one bincount scores them all."""

    def __init__(self, binned: np.ndarray, edges: list[np.ndarray]):
        sizes = np.array([len(e) + 1 for e in edges])
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.total = int(sizes.sum())
        self.flat = binned + self.offsets                                # [n, F] global bin ids
        self.position = np.concatenate([self.offsets[j] + np.arange(len(e)) for j, e in enumerate(edges)])
        self.base = np.concatenate([np.full(len(e), self.offsets[j] - 1) for j, e in enumerate(edges)])
        self.feature = np.concatenate([np.full(len(e), j) for j, e in enumerate(edges)])
        self.bin = np.concatenate([np.arange(len(e)) for e in edges])

    def best(self, g, h, rows, direction=None, bounds=(-np.inf, np.inf)):
        """(gain, feature, bin, left value, right value) of the best split of `rows`, or None.
        `direction` per feature (+1: the score may only rise with it, -1: only fall, 0: free):
        a split whose children's values go the other way is not a candidate; values are
        clipped to `bounds`, the range the node's ancestors allow."""
        G, H = g[rows].sum(), h[rows].sum()
        flat = self.flat[rows].ravel()
        width = self.flat.shape[1]
        cg = np.cumsum(np.bincount(flat, weights=np.repeat(g[rows], width), minlength=self.total))
        ch = np.cumsum(np.bincount(flat, weights=np.repeat(h[rows], width), minlength=self.total))
        before_g = np.where(self.base >= 0, cg[np.maximum(self.base, 0)], 0.0)
        before_h = np.where(self.base >= 0, ch[np.maximum(self.base, 0)], 0.0)
        gl, hl = cg[self.position] - before_g, ch[self.position] - before_h
        gr, hr = G - gl, H - hl
        ok = (hl >= MIN_HESSIAN) & (hr >= MIN_HESSIAN)
        wl = np.clip(-gl / (hl + L2), *bounds)
        wr = np.clip(-gr / (hr + L2), *bounds)
        if direction is not None:
            sign = direction[self.feature]
            ok &= sign * (wr - wl) >= 0
        if not ok.any():
            return None
        if np.isfinite(bounds).any():
            # The loss reduction of the clipped values (g²/(h+λ) when unclipped).
            def reduction(gs, hs, w):
                return -(2 * gs * w + (hs + L2) * w * w)
            w0 = float(np.clip(-G / (H + L2), *bounds))
            gain = reduction(gl, hl, wl) + reduction(gr, hr, wr) - reduction(G, H, w0)
        else:
            gain = gl * gl / (hl + L2) + gr * gr / (hr + L2) - G * G / (H + L2)
        gain = np.where(ok, gain, -np.inf)
        i = int(np.argmax(gain))
        if gain[i] <= 1e-9:
            return None
        return float(gain[i]), int(self.feature[i]), int(self.bin[i]), float(wl[i]), float(wr[i])


def train_trees(x: np.ndarray, y: np.ndarray, weight: np.ndarray, direction: np.ndarray | None = None) -> dict:
    """Boosted trees; `direction` per column (+1 / -1 / 0) makes the score monotone in those
    columns, each tree on its own (a node's split on such a column bounds the values below it)."""
    edges = _bin_edges(x)
    binned = np.stack([np.searchsorted(e, x[:, j], side="left") if len(e) else np.zeros(len(x), int)
                       for j, e in enumerate(edges)], axis=1)
    # searchsorted(left) gives the count of edges < value: value > edge[k] iff bin > k.
    splits = _Splits(binned, edges)
    prior = float(np.average(y, weights=weight))
    base = float(np.log(prior / (1 - prior)))
    logit = np.full(len(y), base)
    n_inner, n_leaf = 2 ** DEPTH - 1, 2 ** DEPTH
    trees = []
    for _ in range(ROUNDS):
        p = 1 / (1 + np.exp(-logit))
        g, h = (p - y) * weight, np.maximum(p * (1 - p), 1e-6) * weight
        feature = [0] * n_inner
        split = [float("inf")] * n_inner      # "never right": a node that does not split
        leaf = [0.0] * n_leaf
        members = {0: np.arange(len(y))}
        bounds = {0: (-np.inf, np.inf)}
        for node in range(n_inner):
            rows, bound = members.pop(node), bounds.pop(node)
            found = splits.best(g, h, rows, direction, bound) if len(rows) else None
            if found is None:
                left, right = rows, rows[:0]
                bounds[2 * node + 1] = bounds[2 * node + 2] = bound
            else:
                _, j, k, wl, wr = found
                feature[node], split[node] = j, float(edges[j][k])
                go_right = binned[rows, j] > k
                left, right = rows[~go_right], rows[go_right]
                sign = 0 if direction is None else direction[j]
                middle = (wl + wr) / 2
                bounds[2 * node + 1] = (bound[0], middle) if sign > 0 else (middle, bound[1]) if sign < 0 else bound
                bounds[2 * node + 2] = (middle, bound[1]) if sign > 0 else (bound[0], middle) if sign < 0 else bound
            members[2 * node + 1], members[2 * node + 2] = left, right
        leaf_rows = np.full(len(y), -1)
        for node, rows in members.items():
            i = node - n_inner
            low, high = bounds[node]
            value = float(-LEARNING_RATE * g[rows].sum() / (h[rows].sum() + L2)) if len(rows) else 0.0
            leaf[i] = min(max(value, LEARNING_RATE * low), LEARNING_RATE * high)
            leaf_rows[rows] = i
        logit = logit + np.array(leaf)[leaf_rows]
        trees.append({"feature": feature, "split": [round(s, 6) if np.isfinite(s) else 1e300 for s in split],
                      "leaf": [round(v, 6) for v in leaf]})
    return {"base": round(base, 6), "depth": DEPTH, "trees": trees}


# ---------------------------------------------------------------- calibration

def false_hit_rate(scores, cos, labels, floor, threshold) -> float:
    negatives = labels == 0
    return float(((scores >= threshold) & (cos >= floor) & negatives).sum() / max(1, negatives.sum()))


def calibrate(sets: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], floor: float) -> dict:
    """For each target rate, the least score threshold whose false-hit rate is at or under it
    on every calibration set."""
    thresholds = []
    grid = np.linspace(0.0, 1.0, 1001)
    for rate in RATES:
        chosen = 1.0
        for t in grid:
            if all(false_hit_rate(s, c, y, floor, t) <= rate for s, c, y in sets.values()):
                chosen = float(t)
                break
        thresholds.append(round(chosen, 3))
    # Monotone by construction (a stricter rate never needs a lower threshold).
    return {"rates": list(RATES), "thresholds": thresholds,
            "sets": {name: int((y == 0).sum()) for name, (_, _, y) in sets.items()}}


def choose_floor(cos_label1: np.ndarray) -> float:
    """The cosine that keeps FLOOR_RECALL of the calibration sets' rewordings, down to 0.05."""
    return float(np.floor(np.quantile(cos_label1, 1 - FLOOR_RECALL) * 20) / 20)


def datasets(pairs_path: Path | None = None, handwritten: tuple[Path, ...] = HANDWRITTEN):
    """(train pairs, calibration {name: pairs}) as lists of dicts; each dict gets `cos`."""
    from tune_semantic import DEFAULT_PAIRS, load_pairs
    generated = generate()
    written = [dict(p, file=path.name) for path in handwritten for p in load_jsonl(path)]
    train = [p for p in generated if p["half"] == "train"] + written
    calibration = {"generated-valid": [p for p in generated if p["half"] == "valid"]}
    public = [p for p in load_pairs(pairs_path or DEFAULT_PAIRS) if p.half == "tune"]
    for source in ("qqp", "mrpc-train", "stsb-train"):
        calibration[f"{source}-tune"] = [{"a": p.a, "b": p.b, "label": p.label} for p in public if p.source == source]
    return train, calibration


@dataclass(frozen=True)
class Rows:
    """Every pair the verifier is trained and calibrated on, with its cosine and feature row:
    `cos`, `x` and `labels` hold the training pairs first, then each calibration set in order."""
    train: list[dict]
    calibration: dict[str, list[dict]]
    align: bool         # the four token-alignment features follow the lexical ones
    cos: np.ndarray
    x: np.ndarray
    labels: np.ndarray

    @property
    def names(self) -> tuple[str, ...]:
        return FEATURES + ALIGN_FEATURES if self.align else FEATURES

    def sets(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each calibration set's (feature rows, cosines, labels)."""
        out, offset = {}, len(self.train)
        for name, pairs in self.calibration.items():
            rows = slice(offset, offset + len(pairs))
            out[name] = (self.x[rows], self.cos[rows], self.labels[rows])
            offset += len(pairs)
        return out


def rows(pairs_path: Path | None = None, align: bool = True, handwritten: tuple[Path, ...] = HANDWRITTEN) -> Rows:
    forget_profiles(max_bytes=None)
    train, calibration = datasets(pairs_path, handwritten)
    everything = train + [p for ps in calibration.values() for p in ps]
    cos = cosines(everything)
    x = feature_rows(everything, cos)
    if align:
        x = np.hstack([x, align_rows(everything)])
    return Rows(train, calibration, align, cos, x, np.array([p["label"] for p in everything], float))


def training_weights(train: list[dict], weight: float = HANDWRITTEN_WEIGHT) -> np.ndarray:
    """Each training pair's weight: `weight` for a hand-written one, 1 for a generated one."""
    return np.array([weight if "frame" not in p else 1.0 for p in train])


def directions(names) -> np.ndarray:
    """+1 / -1 / 0 per feature for monotone trees (RISING, FREE, the rest falling)."""
    return np.array([0 if n in FREE else 1 if n in RISING else -1 for n in names])


def fit(data: Rows, weight: float = HANDWRITTEN_WEIGHT, monotone: bool = False) -> tuple[dict, dict]:
    """The trees trained on `data`'s training pairs past TRAIN_COSINE, with their candidate
    floor and thresholds measured on its calibration sets."""
    n = len(data.train)
    x, y, c = data.x[:n], data.labels[:n], data.cos[:n]
    keep = c >= TRAIN_COSINE
    start = time.perf_counter()
    model = train_trees(x[keep], y[keep], training_weights(data.train, weight)[keep],
                        directions(data.names) if monotone else None)
    seconds = time.perf_counter() - start
    model["features"] = list(data.names)
    if data.align:
        model["states_layers"] = STATES_LAYERS     # checked at load (sidecar/cache/verifier.py)
    sets = data.sets()
    label1 = np.concatenate([c_[y_ == 1] for _, c_, y_ in sets.values()])
    model["floor"] = choose_floor(label1)
    model["calibration"] = {"rates": [1.0], "thresholds": [0.5]}   # placeholder to score with
    verifier = Verifier(model)
    scored = {name: (verifier.probabilities(xs), cs, ys) for name, (xs, cs, ys) in sets.items()}
    model["calibration"] = calibrate(scored, model["floor"])
    model["version"] = hashlib.sha256(json.dumps(model["trees"]).encode()).hexdigest()[:12]
    stats = {"train_pairs": int(keep.sum()), "train_label1": int(y[keep].sum()), "seconds": round(seconds, 1),
             "floor": model["floor"], "calibration": model["calibration"]}
    return model, stats


def build(pairs_path: Path | None = None, align: bool = True, monotone: bool = False) -> tuple[dict, dict]:
    return fit(rows(pairs_path, align), monotone=monotone)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=MODEL_PATH)
    parser.add_argument("--check", action="store_true", help="compare with the model at --out; write nothing")
    parser.add_argument("--no-align", action="store_true", help="the 23 lexical features only (no token states)")
    parser.add_argument("--monotone", action="store_true", help="trees monotone in every feature but FREE")
    args = parser.parse_args(argv)
    model, stats = build(align=not args.no_align, monotone=args.monotone)
    print(json.dumps(stats, indent=1))
    text = json.dumps(model, separators=(",", ":")) + "\n"
    if args.check:
        same = args.out.exists() and json.loads(args.out.read_text())["version"] == model["version"]
        print("same as the shipped model" if same else "DIFFERS from the shipped model")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
