"""Experiment: cheaper character n-gram features for the injection classifier, what each costs in
quality (val split only) and what it saves in time.

    nice -n 19 .venv/bin/python scripts/exp_guard_lexical.py train [VARIANT ...]
    .venv/bin/python scripts/exp_guard_lexical.py cost [--rounds 6]

A variant changes the feature definition of sidecar/guard/lexical.py: the table size
(`bits`: 2**bits buckets), the n-gram orders, the width of the rolling hash (uint64 or uint32)
and the width of the code points handed to it (which changes the cost, not the features). Each
variant's main head and n-gram head are trained exactly as scripts/train_guard.py trains them
(same data, splits, optimizer, L2, epoch chosen on val) and scored as the sidecar scores
(float16 weights, the highest of the whole text's and every 200-character stretch's score).
`train` reports on val prompts: detection at the thresholds that flag 0.1% and 1% of ordinary
val prompts, the look-alikes flagged there, the n-gram head's detection on the val prompts the
model does not embed, each against today's features with a paired bootstrap interval; it writes
reports/guard_lexical.json and keeps each variant's weights in build/exp_guard_lexical/.
`cost` times each variant's `score` with its trained weights on the prompts of
`make bench-guard-cost`, in process, the variants round-robin per prompt so they share the
load, time.thread_time(), several rounds, the load average of each; writes
reports/guard_lexical_cost.json. The test splits are not read.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.guard_data import ORDINARY_SOURCES, embed_all, injection_examples  # noqa: E402
from sidecar.guard import lexical  # noqa: E402
from sidecar.guard.normalize import fold  # noqa: E402
import train_guard  # noqa: E402
from exp_guard_models import paired_difference, recall_at  # noqa: E402
from train_guard import Ngrams  # noqa: E402

STORE = ROOT / "build" / "exp_guard_lexical"
RATES = (0.001, 0.01)


@dataclass(frozen=True)
class Features:
    """lexical.py's features and score, with the definition as parameters."""
    bits: int = lexical.DIM_BITS
    orders: tuple[int, ...] = lexical.ORDERS
    hash32: bool = False      # the rolling hash in uint32 instead of uint64
    narrow: bool = False      # code points as read (uint8 for ASCII, uint16 or uint32), no cast

    @property
    def dim(self) -> int:
        return 1 << self.bits

    @property
    def key(self) -> tuple:       # what the weights depend on (`narrow` changes only the cost)
        return (self.bits, self.orders, self.hash32)

    def _dtype(self):
        return np.uint32 if self.hash32 else np.uint64

    def points(self, text: str) -> np.ndarray:
        folded = fold(text)
        if folded.isascii():
            raw = b" ".join(folded.encode("ascii").split())
            if len(raw) > lexical.MAX_CHARS:
                raw = raw[:lexical.MAX_CHARS // 2] + b" " + raw[-lexical.MAX_CHARS // 2:]
            points = np.frombuffer(b" " + raw + b" ", np.uint8)
        else:
            folded = " ".join(folded.split())
            if len(folded) > lexical.MAX_CHARS:
                folded = folded[:lexical.MAX_CHARS // 2] + " " + folded[-lexical.MAX_CHARS // 2:]
            wide = " " + folded + " "
            if self.narrow and max(wide) < "\ud800":
                points = np.frombuffer(wide.encode("utf-16-le"), np.uint16)
            else:
                points = np.frombuffer(wide.encode("utf-32-le", "surrogatepass"), np.uint32)
        return points if self.narrow else points.astype(self._dtype())

    def hashed(self, points: np.ndarray) -> tuple[np.ndarray, list[int]]:
        dtype = self._dtype()
        if self.hash32:
            prime, mix, shift = dtype(0x01000193), dtype(0x9E3779B1), dtype(32 - self.bits)
        else:
            prime, mix, shift = dtype(0x100000001B3), dtype(0x9E3779B97F4A7C15), dtype(64 - self.bits)
        lengths = [max(0, len(points) - n + 1) for n in self.orders]
        flat = np.empty(sum(lengths), dtype)
        with np.errstate(over="ignore"):
            rolling, at = points, 0
            for n in range(2, max(self.orders) + 1):
                size = max(0, len(points) - n + 1)
                if n in self.orders:
                    step = flat[at:at + size]
                    at += size
                else:
                    step = np.empty(size, dtype)
                np.multiply(rolling[:size], prime, out=step, casting="unsafe")
                np.add(step, points[n - 1:], out=step, casting="unsafe")
                rolling = step
            if 1 in self.orders:
                raise ValueError("order 1 is not a variant here")
            at = 0
            for n, size in zip(self.orders, lengths):
                flat[at:at + size] ^= dtype(n)
                at += size
            flat *= mix
            flat >>= shift
        # below 2**bits: the same values as int64 (take reads uint32 indices as they are)
        return flat if self.hash32 else flat.view(np.int64), lengths

    def buckets(self, text: str) -> np.ndarray:
        return self.hashed(self.points(text))[0].astype(np.int64)

    def tail_roots(self) -> tuple[float, ...]:
        return lexical.tail_roots(self.orders)

    def score(self, weights: np.ndarray, text: str, tail_roots=None) -> float:
        """lexical.score with this definition (same windows)."""
        points = self.points(text)
        flat, lengths = self.hashed(points)
        return lexical.windowed(weights, flat, lengths, len(points), self.orders, tail_roots or self.tail_roots())


VARIANTS = {
    "today": Features(),
    "bits16": Features(bits=16),
    "bits15": Features(bits=15),
    "orders35": Features(orders=(3, 5)),
    "orders4": Features(orders=(4,)),
    "orders34": Features(orders=(3, 4)),
    "hash32": Features(hash32=True),
    "hash32_narrow": Features(hash32=True, narrow=True),
    "bits16_hash32": Features(bits=16, hash32=True),
    "bits15_hash32": Features(bits=15, hash32=True),
    "bits15_orders35_hash32": Features(bits=15, orders=(3, 5), hash32=True),
    "bits15_orders4_hash32": Features(bits=15, orders=(4,), hash32=True),
}


def check_today(texts: list[str]) -> None:
    """The `today` variant is lexical.py, bucket for bucket and score for score."""
    f = VARIANTS["today"]
    weights = np.random.default_rng(0).standard_normal(lexical.DIM).astype(np.float32)
    for text in texts:
        assert np.array_equal(np.sort(f.buckets(text)), np.sort(lexical.buckets(text))), text[:60]
        assert abs(f.score(weights, text) - lexical.score(weights, text)) < 1e-6, text[:60]


def _half(weights: np.ndarray) -> np.ndarray:
    return weights.astype(np.float16).astype(np.float32)     # as the head file stores them


def train_variant(f: Features, examples: list, vectors: np.ndarray) -> dict:
    """Both heads, trained as train_guard.py trains them, with `f`'s features."""
    y = np.array([e.label for e in examples], np.float64)
    is_train = np.array([e.split == "train" for e in examples])
    every = Ngrams([e.text for e in examples], buckets=f.buckets, dim=f.dim)
    text_params, text_epoch, _ = train_guard.train(np.zeros((len(examples), 0)), every, y, is_train, ~is_train)
    usable = ~np.isnan(vectors).any(axis=1)
    rows = np.flatnonzero(usable)
    ngrams = Ngrams([examples[i].text for i in rows], buckets=f.buckets, dim=f.dim)
    params, epoch, _ = train_guard.train(vectors[rows].astype(np.float64), ngrams, y[rows], is_train[rows], ~is_train[rows])
    return {"embedding": _half(params["embedding"]), "lexical": _half(params["lexical"]),
            "bias": np.float32(params["bias"]), "epoch": epoch,
            "text_lexical": _half(text_params["lexical"]), "text_bias": np.float32(text_params["bias"]),
            "text_epoch": text_epoch}


def val_scores(f: Features, w: dict, examples: list, vectors: np.ndarray) -> dict:
    """Logits of every val prompt as the sidecar computes them: the main head where there is an
    embedding (NaN elsewhere), the n-gram head for all."""
    val = [i for i, e in enumerate(examples) if e.split == "val"]
    roots = f.tail_roots()
    main = np.full(len(val), np.nan)
    text = np.empty(len(val))
    for k, i in enumerate(val):
        t = examples[i].text
        text[k] = f.score(w["text_lexical"], t, roots) + w["text_bias"]
        if not np.isnan(vectors[i]).any():
            main[k] = float(vectors[i].astype(np.float32) @ w["embedding"]) + f.score(w["lexical"], t, roots) + w["bias"]
    return {"main": main, "text": text}


def _path(f: Features) -> Path:
    bits, orders, h = f.key
    return STORE / f"b{bits}_o{''.join(map(str, orders))}_{'u32' if h else 'u64'}.npz"


def weights_of(f: Features, examples=None, vectors=None) -> dict:
    path = _path(f)
    if path.exists():
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    if examples is None:
        raise SystemExit(f"{path} missing: run `train` first")
    w = train_variant(f, examples, vectors)
    STORE.mkdir(parents=True, exist_ok=True)
    np.savez(path, **w)
    return w


def train_main(names: list[str]) -> int:
    examples = [e for e in injection_examples() if e.split != "test"]
    vectors = embed_all([e.text for e in examples])
    val = [e for e in examples if e.split == "val"]
    check_today([e.text for e in val[:300:7]] + [e.text for e in val if not e.text.isascii()][:40])
    y = np.array([e.label for e in val])
    embedded = ~np.isnan(vectors[[i for i, e in enumerate(examples) if e.split == "val"]]).any(axis=1)
    ordinary = np.array([e.source in ORDINARY_SOURCES for e in val])
    attacks, hard = y == 1, (y == 0) & ~ordinary
    print(f"val: {int(attacks.sum())} attacks ({int((attacks & ~embedded).sum())} without an embedding), "
          f"{int(hard.sum())} look-alikes, {int(ordinary.sum())} ordinary", flush=True)
    scores: dict = {}
    for name in ["today"] + [n for n in (names or VARIANTS) if n != "today"]:
        f = VARIANTS[name]
        started = time.monotonic()
        w = weights_of(f, examples, vectors)
        s = val_scores(f, w, examples, vectors)
        scores[name] = s
        m = s["main"]
        row = {"bits": f.bits, "orders": list(f.orders), "hash": "uint32" if f.hash32 else "uint64",
               "epoch": int(w["epoch"]), "text_epoch": int(w["text_epoch"]),
               "nonzero_buckets": int(np.count_nonzero(w["lexical"]))}
        for rate in RATES:
            # the main head judges the embedded val prompts; its threshold from the ordinary ones
            a, o, h = attacks & embedded, ordinary & embedded, hard & embedded
            z = np.where(embedded, m, -np.inf)
            d, threshold = recall_at(z, a, o, rate)
            row[f"main@{rate}"] = {"detection": round(d, 3), "caught": int((z[a] >= threshold).sum()), "attacks": int(a.sum()),
                                   "lookalikes_flagged": int((z[h] >= threshold).sum()), "lookalikes": int(h.sum())}
            # the n-gram head: threshold from every ordinary val prompt (as shipped), judged on
            # the prompts without an embedding
            t = s["text"]
            _, tt = recall_at(t, attacks, ordinary, rate)
            no = ~embedded
            row[f"text@{rate}"] = {"caught": int((t[attacks & no] >= tt).sum()), "attacks": int((attacks & no).sum()),
                                   "lookalikes_flagged": int((t[hard & no] >= tt).sum()), "lookalikes": int((hard & no).sum()),
                                   "ordinary_flagged": int((t[ordinary & no] >= tt).sum()), "ordinary": int((ordinary & no).sum())}
            if name != "today":
                base = scores["today"]
                base_z = np.where(embedded, base["main"], -np.inf)
                row[f"main@{rate}"]["against_today"] = paired_difference(z, base_z, a, o, rate)
                _, base_threshold = recall_at(base_z, a, o, rate)
                row[f"main@{rate}"]["lookalikes_only_this_only_today"] = [
                    int(((z[h] >= threshold) & (base_z[h] < base_threshold)).sum()),
                    int(((z[h] < threshold) & (base_z[h] >= base_threshold)).sum())]
                # paired over the attacks without an embedding, the ordinary prompts resampled
                row[f"text@{rate}"]["against_today"] = paired_difference(t, base["text"], attacks & no, ordinary, rate)
        print(name, json.dumps(row), f"({time.monotonic() - started:.0f} s)", flush=True)
        STORE.mkdir(parents=True, exist_ok=True)
        (STORE / f"{name}.json").write_text(json.dumps(row))
    # every variant's row so far (runs of separate variants can go side by side)
    results = {n: json.loads((STORE / f"{n}.json").read_text()) for n in VARIANTS if (STORE / f"{n}.json").exists()}
    report_path = ROOT / "reports" / "guard_lexical.json"
    report_path.parent.mkdir(exist_ok=True)
    report_path.write_text(json.dumps(results, indent=1))
    print(f"wrote {report_path.relative_to(ROOT)}")
    return 0


def cost_main(rounds: int, kinds: tuple[str, ...]) -> int:
    from bench.guard_cost import workload
    _, prompts = workload(ROOT)
    features = {n: (f, weights_of(f)["lexical"], f.tail_roots()) for n, f in VARIANTS.items()}
    for f, w, roots in features.values():      # the precomputed tail roots give the same score
        text = prompts["ascii_clean"][0]
        assert abs(f.score(w, text, roots) - f.score(w, text)) < 1e-9
    check_today(prompts["ascii_clean"][:5] + prompts["non_ascii"][:5])
    runs = []
    names = list(features)
    for r in range(rounds):
        load = os.getloadavg()[0]
        times: dict = {(k, n): [] for k in kinds for n in names}
        for kind in kinds:
            for i, text in enumerate(prompts[kind]):
                order = names[i % len(names):] + names[:i % len(names)]      # round-robin start
                for n in order:
                    f, w, roots = features[n]
                    started = time.thread_time()
                    f.score(w, text, roots)
                    times[(kind, n)].append(time.thread_time() - started)
        runs.append({"round": r, "load_1m": round(load, 2),
                     **{f"{k}/{n}": round(statistics.median(v) * 1e6, 1) for (k, n), v in times.items()}})
        print(f"round {r}: load {load:.2f}", flush=True)
    rows = {}
    for kind in kinds:
        for n in names:
            per_round = [run[f"{kind}/{n}"] for run in runs]
            ratio = [run[f"{kind}/{n}"] / run[f"{kind}/today"] for run in runs]
            rows[f"{kind}/{n}"] = {"p50_us_median_of_rounds": statistics.median(per_round),
                                   "ratio_to_today_median": round(statistics.median(ratio), 3)}
            print(f"{kind:12s} {n:32s} p50 {statistics.median(per_round):7.1f} us  x{statistics.median(ratio):.3f} of today")
    out = ROOT / "reports" / "guard_lexical_cost.json"
    out.write_text(json.dumps({"rounds": runs, "summary": rows}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["cost"]:
        rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 6
        return cost_main(rounds, ("ascii_clean", "non_ascii"))
    if args[:1] == ["train"]:
        return train_main(args[1:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
