"""Memory of the in-process cache store under a flood of scopes, against its byte budget.

Run: `make bench-cache-memory` (a minute or two).  Writes reports/cache_memory.json.

A caller can open a new cache scope with every request (vary `seed`, the system prompt or an
unknown field), so the store's memory must follow its byte budget whatever the mix of scopes.
Each case runs in a fresh process: RSS is read before the puts and after them, so the growth
is what the store took from the operating system, fragmentation included.

Entries: a 64-hex exact key, a 300-character prompt, an 800-byte answer and (except in the
exact-only cases) a 384-dimension vector, as the sidecar stores them.
Cases:
  one_scope     N entries in one scope.
  scopes        N entries, each in its own scope (the flood).
  scopes_exact  the same without vectors (routes with the semantic tier off).
  ..._budget    the same under a budget smaller than what N entries need: RSS must stay near it.
Columns:
  entries, scopes   what the store holds at the end.
  account_mib       what it charged against max_bytes (MemoryStore.nbytes).
  rss_mib           the process's RSS growth over the puts.
  rss/account       how honest the account is: near 1 means the budget bounds real memory.
  budget_mib        max_bytes.
  put_us            mean time of one put (evictions included).
Use --code DIR to measure another checkout's sidecar package (e.g. a version without the
budget; its account and budget columns stay empty).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from bench import report  # noqa: E402

N = 50_000
MIB = 2**20
CASES = {                   # name: (scopes, vectors, budget in MiB; None: the default)
    "one_scope": ("one", True, None),
    "scopes": ("each", True, None),
    "scopes_exact": ("each", False, None),
    "one_scope_budget": ("one", True, 48),
    "scopes_budget": ("each", True, 48),
    "scopes_exact_budget": ("each", False, 24),
}


def _worker(case: str, n: int, code: str) -> dict:
    sys.path.insert(0, code)
    import numpy as np
    from sidecar.cache.memory_store import MemoryStore
    from sidecar.cache.store import Entry, StoreLimits

    scopes, with_vectors, budget = CASES[case]
    fields = {"max_entries": 10**7, "max_entries_per_scope": 10**6}
    if budget is not None and "max_bytes" not in StoreLimits.__dataclass_fields__:
        return {"case": case}                   # that code has no byte budget
    if budget is not None:
        fields["max_bytes"] = budget * MIB
    limits = StoreLimits(**fields)
    store = MemoryStore(limits, clock=lambda: 1_000.0)
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((256, 384), dtype=np.float32)   # reused: the store copies rows
    gc.collect()
    before = report.rss_mb(os.getpid())
    started = time.perf_counter()
    for i in range(n):
        key = hashlib.sha256(b"key %d" % i).hexdigest()
        scope = "one" if scopes == "one" else hashlib.sha256(b"scope %d" % i).hexdigest()
        prompt = f"{i} " + "p" * 300
        answer = b"a" * 800 + str(i).encode()
        store.put_now(Entry(key, scope, prompt, answer, 1_000.0),
                      vectors[i % 256] if with_vectors else None, 1e9)
    elapsed = time.perf_counter() - started
    gc.collect()
    grown = report.rss_mb(os.getpid()) - before
    account = getattr(store, "nbytes", None)
    scope_count = getattr(store, "scope_count", None)
    return {"case": case, "entries": len(store),
            "scopes": scope_count if scope_count is not None else len(getattr(store, "_scopes", ())),
            "account_mib": None if account is None else account / MIB, "rss_mib": grown,
            "rss/account": None if not account else grown / (account / MIB),
            "budget_mib": getattr(limits, "max_bytes", 0) / MIB or None, "put_us": elapsed / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=N, help="entries per case")
    parser.add_argument("--code", default=str(report.ROOT), help="checkout whose sidecar package to measure")
    parser.add_argument("--case", help=argparse.SUPPRESS)       # worker mode
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_worker(args.case, args.n, args.code)))
        return
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, "-m", "bench.cache_memory", "--case", case, "-n", str(args.n),
                              "--code", args.code], cwd=report.ROOT, check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout))
        print(f"  {case} done", file=sys.stderr)
    columns = ["case", "entries", "scopes", "account_mib", "rss_mib", "rss/account", "budget_mib", "put_us"]
    print(f"{args.n:,} puts per case (code: {args.code})")
    print(report.table(rows, columns))
    name = "cache_memory" if args.code == str(report.ROOT) else "cache_memory_other"
    print(f"wrote {report.write(name, {'n': args.n, 'code': args.code, 'rows': rows})}")


if __name__ == "__main__":
    main()
