"""The guard's labelled prompts and their embeddings, shared by scripts/train_guard.py and
`make eval-guard` (bench/guard.py), so both split the data the same way.

Injection data (label 1 = attack):
  - ../shared/data/guard/prompt_injections.jsonl (deepset, English and German): its `test`
    split is held out; its `train` split is cut 80/20 into train and val by a hash of the id;
  - data/guard/injections.jsonl (written for Sluice, many languages): train / val / test as
    the file says;
  - data/guard/injections_holdout.jsonl and data/guard/injections_holdout2.jsonl, each when
    present (hand-written held-out prompts): every row test, sources "holdout" and "holdout2",
    each reported apart from the others;
  - data/guard/ordinary.jsonl (ordinary requests in Chinese, Japanese, Korean and seven other
    languages, every one benign: the paraphrase set is English): train / val / test as the file says;
  - ../shared/data/paraphrase/dev.jsonl (every prompt benign): by a hash of the prompt's
    paraphrase group (a prompt and its rewordings, joined through the pairs), 25% train, 7%
    val, 12% test, the rest unused.
The test splits are never trained on and never used to choose a threshold.

Personal-data data: data/guard/pii.jsonl (generated, its own dev / test) and
data/guard/pii_handwritten.txt (written prompt by prompt; lines alternate dev / test) and, when
they exist, data/guard/pii_holdout.txt (written apart from the detectors; its misses were
read and fixed, so it is development data), data/guard/pii_holdout2.txt (written apart; its
misses were read and fixed too: development data), data/guard/pii_holdout3.txt (written
apart; its misses were read and fixed too: development data), data/guard/pii_holdout4.txt
(written apart; its misses were read: development data) and data/guard/pii_holdout5.txt
(written apart, the blind set: reported only).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SLUICE_SHARED_DATA", ROOT.parent / "shared" / "data"))
OURS = ROOT / "data" / "guard" / "injections.jsonl"
ORDINARY = ROOT / "data" / "guard" / "ordinary.jsonl"
# Hand-written held-out prompts (data/guard/README.md): every row is test, source "holdout",
# reported apart; never trained on, never used to choose anything.
HOLDOUT = ROOT / "data" / "guard" / "injections_holdout.jsonl"
HOLDOUT2 = ROOT / "data" / "guard" / "injections_holdout2.jsonl"
HOLDOUT_SOURCES = ("holdout", "holdout2")


def holdout_files() -> dict[str, Path]:
    """Each held-out file by its source name."""
    return {"holdout": HOLDOUT, "holdout2": HOLDOUT2}

# Sources of ordinary prompts (not written to look like attacks): a route's false_alarm_rate is
# a share of these.
ORDINARY_SOURCES = ("paraphrase", "ordinary")
PII = ROOT / "data" / "guard" / "pii.jsonl"
PII_HANDWRITTEN = ROOT / "data" / "guard" / "pii_handwritten.txt"
# Written apart from the detectors' development, in the same format, every line one source:
# the first three sets' misses were read and fixed (development data); the fourth is blind.
PII_HOLDOUT = ROOT / "data" / "guard" / "pii_holdout.txt"
PII_HOLDOUT2 = ROOT / "data" / "guard" / "pii_holdout2.txt"
PII_HOLDOUT3 = ROOT / "data" / "guard" / "pii_holdout3.txt"
PII_HOLDOUT4 = ROOT / "data" / "guard" / "pii_holdout4.txt"
PII_HOLDOUT5 = ROOT / "data" / "guard" / "pii_holdout5.txt"
# Per id series of injections.jsonl and ordinary.jsonl, the first row of the latest batch
# (Chinese attacks, orders appended to documents, look-alikes of the same shapes, ordinary
# pasted-document requests: data/guard/README.md). `make eval-guard` also reports the test rows below these
# numbers apart (`earlier_rows`): a set comparable with figures measured on those rows alone.
LATER_BATCH = {"atk": 1405, "ben": 1300, "ord": 1019}
CACHE = ROOT / "build" / "guard" / "embeddings.npz"
STATES_CACHE = ROOT / "build" / "guard" / "pooled_states.npz"
# Pooled token states per text (pooled_states): layer-4 states (the graph's token_states output,
# rounded to float16 as the service hands them over) and the last layer's, max- and mean-pooled.
POOLINGS = ("l4_max", "l4_mean", "last_max")


@dataclass(frozen=True)
class Example:
    text: str
    label: int
    split: str        # train | val | test
    source: str       # deepset | sluice | holdout | holdout2 (attacks and look-alikes) | paraphrase | ordinary | generated
    lang: str
    earlier: bool = True    # False: a row at or past its series' number in LATER_BATCH


def _bucket(key: str) -> float:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def _read(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _earlier(row_id: str) -> bool:
    series, _, number = row_id.rpartition("-")
    return series not in LATER_BATCH or int(number) < LATER_BATCH[series]


def injection_examples(paraphrase_limit: int | None = None, extra_ordinary: bool = False) -> list[Example]:
    """Every labelled prompt with its split; extra_ordinary=True also trains on the paraphrase
    groups no split uses (more ordinary prompts; val and test unchanged)."""
    out: list[Example] = []
    deepset = SHARED / "guard" / "prompt_injections.jsonl"
    for row in _read(deepset):
        split = "test" if row["split"] == "test" else ("val" if _bucket(row["id"]) < 0.2 else "train")
        out.append(Example(row["text"], int(row["label"]), split, "deepset", "en+de"))
    for row in _read(OURS):
        out.append(Example(row["text"], int(row["label"]), row["split"], "sluice", row["lang"], _earlier(row["id"])))
    for source, path in holdout_files().items():
        if path.exists():
            for row in _read(path):
                out.append(Example(row["text"], int(row["label"]), "test", source, row["lang"]))
    for row in _read(ORDINARY):
        out.append(Example(row["text"], 0, row["split"], "ordinary", row["lang"], _earlier(row["id"])))
    texts = _paraphrase_texts()
    if paraphrase_limit is not None:
        texts = texts[:paraphrase_limit]
    for text, group in texts:
        b = _bucket(group)
        split = "train" if b < 0.05 or 0.24 <= b < 0.44 else "val" if b < 0.12 else "test" if b < 0.24 else None
        if split is None and extra_ordinary:
            split = "train"
        if split is not None:
            out.append(Example(text, 0, split, "paraphrase", "en"))
    return out


def generated_examples(examples: list[Example], seed: int = 22) -> list[Example]:
    """Training rows made from train rows only (source "generated", split "train"; never val or
    test): each train attack and look-alike set inside an ordinary document built from train
    paraphrase prompts (appended after it, or between two parts of it), as indirect injection
    arrives, with the label of the prompt planted; and the documents alone (label 0), so that
    length and a document's shape do not themselves read as an attack."""
    rng = random.Random(seed)
    train = [e for e in examples if e.split == "train"]
    ordinary = [e.text for e in train if e.source == "paraphrase"]
    planted = [e for e in train if e.source in ("deepset", "sluice")]
    if not ordinary:
        return []

    def document() -> str:
        return " ".join(rng.choice(ordinary) for _ in range(rng.randint(1, 4)))

    out = []
    for e in planted:
        out.append(Example(document() + "\n\n" + e.text, e.label, "train", "generated", e.lang))
        out.append(Example(document() + "\n" + e.text + "\n" + document(), e.label, "train", "generated", e.lang))
    for _ in range(len(planted) // 2):
        out.append(Example(document(), 0, "train", "generated", "en"))
    return out


class Groups:
    """Items joined into groups (union-find), each group named by its least item."""

    def __init__(self, items=()) -> None:
        self._parent = {item: item for item in items}

    def add(self, item) -> None:
        self._parent.setdefault(item, item)

    def root(self, item):
        parent = self._parent
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    def join(self, a, b) -> None:
        a, b = self.root(a), self.root(b)
        if a != b:
            self._parent[max(a, b)] = min(a, b)

    def __iter__(self):
        return iter(self._parent)


def _paraphrase_texts() -> list[tuple[str, str]]:
    """Each distinct paraphrase prompt with its group: the prompts joined by pairs (a question
    and its rewordings) form one group, split together, so no test prompt has a near-copy in
    the training data."""
    groups = Groups()
    for row in _read(SHARED / "paraphrase" / "dev.jsonl"):
        pair = [t for t in (row["a"], row["b"]) if t]
        for text in pair:
            groups.add(text)
        if len(pair) == 2:
            groups.join(pair[0], pair[1])
    return [(text, groups.root(text)) for text in groups]


def pii_examples() -> list[dict]:
    return _read(PII)


_MARK = re.compile(r"\[\[(\w+)\|(.*?)\]\]|\{\{([\w-]+)\|(.*?)\}\}", re.DOTALL)


def pii_handwritten(path: Path = PII_HANDWRITTEN, holdout: bool = False) -> list[dict]:
    """data/guard/pii_handwritten.txt (or a file in its format) as rows shaped like
    pii.jsonl's: `[[detector|value]]` marks planted data, `{{kind|value}}` a look-alike; lines
    alternate dev / test, or are all `holdout`."""
    rows = []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith("#")]
    for number, line in enumerate(lines):
        lang, marked = line.split("\t", 1)
        marked = marked.replace("\\n", "\n")
        text, items, lookalikes, at = [], [], [], 0
        for m in _MARK.finditer(marked):
            text.append(marked[at:m.start()])
            if m.group(1):
                items.append({"detector": m.group(1), "value": m.group(2)})
            else:
                lookalikes.append({"kind": m.group(3), "value": m.group(4)})
            text.append(m.group(2) or m.group(4))
            at = m.end()
        text.append(marked[at:])
        rows.append({"id": f"hand-{number:03d}", "lang": lang, "text": "".join(text), "items": items,
                     "lookalikes": lookalikes, "split": "holdout" if holdout else "dev" if number % 2 == 0 else "test"})
    return rows


def embed_all(texts: list[str]) -> np.ndarray:
    """Unit vectors of `texts` from the served int8 model, remembered in build/guard/; a row of
    NaN for a text the model refuses (NothingToEmbed: mostly unknown tokens), which the sidecar
    would not embed either."""
    known: dict[str, np.ndarray] = {}
    if CACHE.exists():
        with np.load(CACHE, allow_pickle=False) as data:
            known = dict(zip(data["texts"].tolist(), data["vectors"]))
    missing = [t for t in dict.fromkeys(texts) if t not in known]
    if missing:
        from sidecar.embedding import EmbeddingSettings
        from sidecar.embedding.loader import load
        encoder = load(EmbeddingSettings.from_env()).encoder
        saved = time.monotonic()
        for start in range(0, len(missing), 256):
            chunk = missing[start:start + 256]
            for indices, outcomes in encoder.encode_iter(chunk):
                for index, outcome in zip(indices, outcomes):
                    known[chunk[index]] = (outcome if isinstance(outcome, np.ndarray)
                                           else np.full(384, np.nan, np.float32))
            print(f"  embedded {min(start + 256, len(missing))}/{len(missing)}", flush=True)
            # The cache is hundreds of MB: written every minute and at the end, not per chunk.
            if time.monotonic() - saved > 60 or start + 256 >= len(missing):
                _save_cache(known)
                saved = time.monotonic()
    return np.stack([known[t] for t in texts]).astype(np.float32)


def _save_cache(known: dict[str, np.ndarray]) -> None:
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    keys = list(known)
    partial = CACHE.with_suffix(".partial.npz")
    np.savez(partial, texts=np.array(keys), vectors=np.stack([known[k] for k in keys]).astype(np.float32))
    partial.replace(CACHE)       # a reader never sees half a file



def pooled_states(texts: list[str]) -> dict[str, np.ndarray]:
    """For each of POOLINGS, [len(texts), 384] unit rows (NaN where the model refuses the text),
    from the served model's run: the same tokens and graph the sidecar uses. Remembered in
    build/guard/, keyed by the model file's sha256 and the text."""
    from sidecar.embedding import EmbeddingSettings
    from sidecar.embedding.model_files import resolve_files
    settings = EmbeddingSettings.from_env()
    sha = resolve_files(settings).model_sha256
    known: dict[str, np.ndarray] = {}
    if STATES_CACHE.exists():
        with np.load(STATES_CACHE, allow_pickle=False) as data:
            if str(data["model_sha256"]) == sha:
                known = dict(zip(data["texts"].tolist(), data["pooled"]))
    missing = [t for t in dict.fromkeys(texts) if t not in known]
    if missing:
        known.update(_pool_states(missing, settings))
        keys = list(known)
        STATES_CACHE.parent.mkdir(parents=True, exist_ok=True)
        partial = STATES_CACHE.with_suffix(".partial.npz")
        np.savez(partial, texts=np.array(keys), pooled=np.stack([known[k] for k in keys]), model_sha256=sha)
        partial.replace(STATES_CACHE)
    stacked = np.stack([known[t] for t in texts])
    return {name: stacked[:, i] for i, name in enumerate(POOLINGS)}


def max_pool(states: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[batch, tokens, dim] token states and their [batch, tokens] attention mask to each row's
    elementwise maximum over its real tokens ([CLS] and [SEP] included), unit-normalised: a word
    that makes an order lights its dimensions wherever it stands, where the mean thins it by the
    prompt's length. Padding never counts (a row of padding alone gives zeros)."""
    masked = np.where(mask[..., None].astype(bool), states.astype(np.float32), -np.inf)
    pooled = masked.max(axis=1)
    pooled[~np.isfinite(pooled)] = 0.0
    return _unit(pooled)


def mean_pool(states: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """As max_pool, with the mean over the real tokens: the embedder's own pooling."""
    from sidecar.embedding.tensors import mean_pool_normalize
    return mean_pool_normalize(states, mask)


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def token_states(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every layer-4 token state of `texts` (real tokens only, float16 as the service hands them
    over), stacked: states [tokens, 384] and offsets [len(texts) + 1] (text i's rows are
    offsets[i]:offsets[i + 1]; none for a text the model refuses). Not cached: ~200 MB for the
    guard's train and val prompts, a couple of minutes to compute."""
    from sidecar.embedding import EmbeddingSettings
    runs: dict[str, np.ndarray] = {}
    for chunk, l4, _last, mask in _model_runs(list(dict.fromkeys(texts)), EmbeddingSettings.from_env()):
        for row, text in enumerate(chunk):
            runs[text] = l4[row, :int(mask[row].sum())]
    empty = np.zeros((0, 384), np.float16)
    rows = [runs.get(t, empty) for t in texts]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    return np.concatenate(rows), offsets


def _pool_states(texts: list[str], settings) -> dict[str, np.ndarray]:
    out = {t: np.full((len(POOLINGS), 384), np.nan, np.float32) for t in texts}
    for chunk, l4, last, mask in _model_runs(texts, settings):
        pooled = np.stack([max_pool(l4, mask), mean_pool(l4, mask), max_pool(last, mask)], axis=1)
        for text, row in zip(chunk, pooled):
            out[text] = row
    return out


def _model_runs(texts: list[str], settings):
    """(texts, layer-4 states float16, last hidden states, mask) per model run of up to 32 texts
    of like length; texts the model refuses are left out."""
    from sidecar.embedding.errors import NothingToEmbed
    from sidecar.embedding.loader import load
    encoder = load(settings).encoder
    if not encoder.has_states:
        raise SystemExit("the embedding model has no token_states output: run `make model`")
    tokenized = []
    for text in texts:
        try:
            tokenized.append((text, encoder.tokenize(text)))
        except NothingToEmbed:
            pass
    tokenized.sort(key=lambda t: len(t[1]))
    for start in range(0, len(tokenized), 32):
        chunk = tokenized[start:start + 32]
        last, l4, mask = encoder.run_unpooled([t[1] for t in chunk])
        yield [t[0] for t in chunk], l4.astype(np.float16), last, mask
        if (start // 32) % 50 == 0:
            print(f"  token states {start + len(chunk)}/{len(tokenized)}", flush=True)
