"""Long fuzzing runs of the sidecar's request path: hostile client bodies and upstream answers.

Run: `make fuzz` (or `.venv/bin/python -m bench.fuzz --clients N --answers M`). Defaults:
1,000,000 client bodies and 100,000 upstream answers, each through the real ext_proc servicer
(codec, processor, the pipeline's cache and route stages with admission and token limits, capture,
usage meter, replay of what was stored); devtools/fuzzing.py says how inputs are made.
`--max-seconds` stops each part early on a slow machine: the table says how many ran.

Columns, per part:
  inputs       how many ran (an upstream answer is two requests: the one it answers, then
               the same question again, served from what was stored or upstream again).
  per_s        inputs a second on this machine.
  outcomes     what the sidecar answered: 400 (the client's mistake), upstream (let go,
               decided), 200 (a cache hit), 429 (a tenant's limit), 500 (a bug, refused).
  unexpected   exceptions that reached the server's last resort, protocol errors and
               exceptions that left the stream: the goal is 0.
Writes reports/fuzz.json with the first tracebacks of any unexpected exception.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

from bench.report import table, write
from devtools import fuzzing

PROGRESS_EVERY = 50_000


async def _part(driver: fuzzing.Driver, name: str, count: int, seed: int, max_seconds: float) -> dict:
    """Runs `count` inputs of one kind in batches until done or out of time."""
    make = fuzzing.run_client_inputs if name == "client bodies" else fuzzing.run_upstream_answers
    started = time.perf_counter()
    done, batch = 0, 1000
    while done < count and time.perf_counter() - started < max_seconds:
        size = min(batch, count - done)
        await make(driver, size, seed + done)
        done += size
        if done % PROGRESS_EVERY == 0:
            print(f"  {name}: {done:,} in {time.perf_counter() - started:,.0f}s", flush=True)
    elapsed = time.perf_counter() - started
    return {"part": name, "inputs": done, "seconds": round(elapsed, 1), "per_s": done / elapsed if elapsed else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1_000_000)
    parser.add_argument("--answers", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=float("inf"), help="per part")
    args = parser.parse_args()
    # The sidecar's own once-a-minute log of a bug stays; the harness keeps the tracebacks.
    logging.basicConfig(level=logging.ERROR)

    async def run() -> list[dict]:
        rows = []
        for name, count, seed in (("client bodies", args.clients, args.seed * 10_000_000),
                                  ("upstream answers", args.answers, args.seed * 10_000_000 + 5_000_000)):
            driver = fuzzing.Driver()
            await driver.start()
            try:
                row = await _part(driver, name, count, seed, args.max_seconds)
            finally:
                await driver.close()
            tally = driver.tally
            row["unexpected"] = tally.unexpected_count
            row["outcomes"] = " ".join(f"{k}={v}" for k, v in sorted(tally.outcomes.items())
                                       if not k.startswith("unexpected"))
            row["first_unexpected"] = [vars(u) | {"sample": u.sample.decode("utf-8", "backslashreplace")}
                                       for u in tally.unexpected]
            rows.append(row)
        return rows

    rows = asyncio.run(run())
    print(table(rows, ["part", "inputs", "seconds", "per_s", "unexpected", "outcomes"]))
    for row in rows:
        for found in row["first_unexpected"][:3]:
            print(f"\n{row['part']}: {found['kind']} ({found['where']}) on {found['sample'][:200]!r}\n{found['traceback']}")
    path = write("fuzz", {"args": vars(args) | {"max_seconds": None if args.max_seconds == float("inf")
                                                else args.max_seconds}, "results": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
