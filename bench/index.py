"""Semantic-lookup cost of the per-scope vector index, and how exact its answers are.

Run: `.venv/bin/python -m bench.index` (under a minute; `--compare` adds the HNSW
libraries, which take minutes to build 100k rows on 2 cores).  Writes reports/index.json.

OpenBLAS runs one thread here unless OPENBLAS_NUM_THREADS says otherwise, as the sidecar
should: on a busy 2-core machine its threaded mat-vec measured 25x slower (10k rows: 8 ms
against 0.3 ms at p50), its idle workers spinning against the event loop.

Data: N random unit vectors of 384 dimensions (the embedding's size), 5% of them near
duplicates (cosine ~0.97) of others, as repeated prompts are.  Random vectors are the hard
case for every approximate method here: real embeddings cluster, and a cluster is easier.

Queries, half of each kind, timed one at a time (the sidecar looks up one prompt at once):
  near  a stored vector moved to a cosine of 0.80-0.99: a hit the cache should serve.
  far   a fresh random vector (best stored cosine ~0.25): a miss.
Columns:
  p50_us, p99_us  lookup latency over all queries, min_similarity 0.8.
  recall_near     share of near queries whose answer is the exact scan's best row.
  false_hits      far queries answered with a row although the exact scan has none >= 0.8.
  recall_any      recall@1 with no threshold (min_similarity -1) on far queries: how well
                  the method ranks rows that no cache would serve; informative only.
  build_s, mb     time to add the N rows; memory the index holds (the libraries: their
                  serialised size).
Methods:
  exact   VectorIndex with the exact scan at every size (a numpy float32 mat-vec).
  sluice  VectorIndex as configured: exact up to 4096 rows, sign-bit prefilter above.
  hnswlib / usearch / faiss-hnsw  (--compare) HNSW graphs, M=16, ef_construction=100,
          ef_search=64, inner product.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse  # noqa: E402
import gc  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench import report  # noqa: E402
from sidecar.cache.vector_index import DEFAULT_EXACT_MAX, VectorIndex  # noqa: E402

DIM = 384
THRESHOLD = 0.8
SIZES = (1_000, 10_000, 100_000)


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _towards(rng: np.random.Generator, rows: np.ndarray, cosines: np.ndarray) -> np.ndarray:
    """Unit vectors at exactly `cosines` to each unit row."""
    noise = rng.standard_normal(rows.shape, dtype=np.float32)
    noise -= np.sum(noise * rows, axis=1, keepdims=True) * rows
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    c = cosines[:, None].astype(np.float32)
    return c * rows + np.sqrt(1 - c * c) * noise


def dataset(n: int, queries: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = _unit(rng, n)
    dups = rng.choice(n, n // 20, replace=False)
    data[dups] = _towards(rng, data[rng.integers(0, n, dups.shape[0])], np.full(dups.shape[0], 0.97))
    near = _towards(rng, data[rng.integers(0, n, queries)], rng.uniform(0.80, 0.99, queries))
    return data, near, _unit(rng, queries)


class _Ours:
    def __init__(self, exact_max: int) -> None:
        self.index = VectorIndex(DIM, exact_max=exact_max)

    def build(self, data: np.ndarray) -> None:
        for i, v in enumerate(data):
            self.index.add(str(i), v)

    def search(self, q: np.ndarray, threshold: float) -> int | None:
        found = self.index.search(q, threshold)
        return None if found is None else int(found[0])

    def mb(self) -> float:
        return self.index.nbytes / 2**20


class _Library:
    """An HNSW library: build in one call, search one query at a time."""

    def __init__(self, name: str) -> None:
        self.name = name

    def build(self, data: np.ndarray) -> None:
        n = data.shape[0]
        ids = np.arange(n)
        if self.name == "hnswlib":
            import hnswlib
            self.index = hnswlib.Index(space="ip", dim=DIM)
            self.index.init_index(max_elements=n, M=16, ef_construction=100)
            self.index.add_items(data, ids, num_threads=1)
            self.index.set_ef(64)
        elif self.name == "usearch":
            from usearch.index import Index
            self.index = Index(ndim=DIM, metric="ip", dtype="f32", connectivity=16,
                               expansion_add=100, expansion_search=64)
            self.index.add(ids, data, threads=1)
        else:
            import faiss
            faiss.omp_set_num_threads(1)
            self.index = faiss.IndexHNSWFlat(DIM, 16, faiss.METRIC_INNER_PRODUCT)
            self.index.hnsw.efConstruction = 100
            self.index.add(data)
            self.index.hnsw.efSearch = 64

    def search(self, q: np.ndarray, threshold: float) -> int | None:
        if self.name == "hnswlib":
            labels, distances = self.index.knn_query(q, k=1, num_threads=1)
            best, similarity = int(labels[0][0]), 1.0 - float(distances[0][0])
        elif self.name == "usearch":
            found = self.index.search(q, 1, threads=1)
            best, similarity = int(found.keys[0]), 1.0 - float(found.distances[0])
        else:
            similarities, labels = self.index.search(q[None], 1)
            best, similarity = int(labels[0][0]), float(similarities[0][0])
        return best if similarity >= threshold else None

    def mb(self) -> float:
        """Serialised size, vectors and graph (RSS growth would miss the memory it reuses
        from a method measured before it)."""
        if self.name == "usearch":
            return self.index.memory_usage / 2**20
        if self.name == "hnswlib":
            with tempfile.TemporaryDirectory() as tmp:
                self.index.save_index(f"{tmp}/index")
                return os.path.getsize(f"{tmp}/index") / 2**20
        import faiss
        return faiss.serialize_index(self.index).nbytes / 2**20


def _available(name: str) -> bool:
    try:
        __import__({"faiss-hnsw": "faiss"}.get(name, name))
        return True
    except ImportError:
        return False


def measure(method, name: str, data: np.ndarray, near: np.ndarray, far: np.ndarray) -> dict:
    n = data.shape[0]
    truth_near = np.argmax(near @ data.T, axis=1)
    far_scores = far @ data.T
    truth_far = np.argmax(far_scores, axis=1)
    far_has_hit = far_scores.max(axis=1) >= THRESHOLD
    gc.collect()
    start = time.perf_counter()
    method.build(data)
    build_s = time.perf_counter() - start
    mb = method.mb()
    queries = np.concatenate([near, far])
    for q in queries[:20]:  # warm caches and lazy allocations
        method.search(q, THRESHOLD)
    order = np.random.default_rng(0).permutation(queries.shape[0])
    times = np.empty(queries.shape[0])
    answers: list[int | None] = [None] * queries.shape[0]
    for i in order:
        t = time.perf_counter_ns()
        answers[i] = method.search(queries[i], THRESHOLD)
        times[i] = time.perf_counter_ns() - t
    k = near.shape[0]
    recall_near = float(np.mean([a == t for a, t in zip(answers[:k], truth_near)]))
    false_hits = sum(a is not None and not h for a, h in zip(answers[k:], far_has_hit))
    recall_any = float(np.mean([method.search(q, -1.0) == t for q, t in zip(far, truth_far)]))
    return {"method": name, "n": n, "build_s": round(build_s, 2),
            "p50_us": round(float(np.percentile(times, 50)) / 1e3, 1),
            "p99_us": round(float(np.percentile(times, 99)) / 1e3, 1),
            "recall_near": round(recall_near, 3), "false_hits": int(false_hits),
            "recall_any": round(recall_any, 3), "mb": round(mb, 1),
            "bytes_per_row": round(mb * 2**20 / n)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--queries", type=int, default=500, help="queries of each kind")
    parser.add_argument("--compare", action="store_true",
                        help="also build hnswlib, usearch and faiss HNSW indexes (slow)")
    args = parser.parse_args(argv)
    libraries = [n for n in ("hnswlib", "usearch", "faiss-hnsw") if args.compare and _available(n)]
    load = os.getloadavg()[0]
    rows = []
    for n in args.sizes:
        data, near, far = dataset(n, args.queries)
        methods = [("exact", _Ours(exact_max=n)), ("sluice", _Ours(exact_max=DEFAULT_EXACT_MAX))]
        methods += [(name, _Library(name)) for name in libraries]
        for name, method in methods:
            rows.append(measure(method, name, data, near, far))
            print(report.table(rows[-1:], list(rows[-1])).splitlines()[-1], flush=True)
            del method
    columns = ["method", "n", "build_s", "p50_us", "p99_us", "recall_near", "false_hits",
               "recall_any", "mb", "bytes_per_row"]
    print()
    print(report.table(rows, columns))
    print(f"\nthreshold {THRESHOLD}, {args.queries} near + {args.queries} far queries; "
          f"load average at start {load:.1f} on {os.cpu_count()} CPUs")
    path = report.write("index", {"threshold": THRESHOLD, "queries_each": args.queries,
                                  "exact_max": DEFAULT_EXACT_MAX, "load_average": load,
                                  "openblas_threads": os.environ["OPENBLAS_NUM_THREADS"],
                                  "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
