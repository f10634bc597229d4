"""Embeddings of labelled prompts for the verifier's scripts, cached per text under build/semantic/.

The serving engine (through scripts/tune_semantic.py's `_engine`) embeds only texts not yet in
the cache, so adding a test suite does not embed the training pairs again.  The cache file is
keyed by the model and the code that turns text into tensors.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "semantic"


def _cache_file() -> Path:
    from tune_semantic import _engine
    name, _ = _engine()
    code = "".join((ROOT / "sidecar" / "embedding" / f).read_text() for f in ("normalize.py", "tokens.py", "tensors.py"))
    return CACHE / f"text-vectors-{hashlib.sha256((name + code).encode()).hexdigest()[:12]}.npz"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def vectors(texts: list[str]) -> dict[str, np.ndarray]:
    """text -> unit vector, embedding (and caching) only the texts not seen before."""
    from tune_semantic import embed_all
    path = _cache_file()
    known: dict[str, np.ndarray] = {}
    if path.exists():
        data = np.load(path)
        known = dict(zip(data["keys"].tolist(), data["vectors"]))
    missing = sorted({t for t in texts if _digest(t) not in known})
    if missing:
        embedded = embed_all(missing)
        for text, vector in zip(missing, embedded):
            known[_digest(text)] = vector
        keys = sorted(known)
        CACHE.mkdir(parents=True, exist_ok=True)
        np.savez(path, keys=np.array(keys), vectors=np.stack([known[k] for k in keys]))
    return {t: known[_digest(t)] for t in set(texts)}


def cosines(pairs: list[tuple[str, str]]) -> np.ndarray:
    v = vectors([t for pair in pairs for t in pair])
    return np.array([float(np.dot(v[a], v[b])) for a, b in pairs])
