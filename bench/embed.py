"""Embedding engine: the micro-batcher against one text at a time, on this machine's CPU.

Run: `make bench-embed` (= `.venv/bin/python -m bench.embed`); about 3 minutes.

Workload: prompts from the paraphrase set (fields a and b of
../shared/data/paraphrase/dev.jsonl beside the repo, or $SLUICE_PARAPHRASE), shuffled
with a fixed seed; every request embeds the next prompt. C closed-loop clients
(C = 1, 8, 32, 128) on one event loop each await one embedding at a time, for a fixed
time per cell.

Modes (the same loaded model and session; onnxruntime intra-op threads varied):
  one-at-a-time  each request is one model run of one text on one worker thread
                 (await run_in_executor), the best a server without batching can do;
  batcher        sidecar.embedding.batcher as served with the default settings (on a
                 CPU: groups of a quarter of the backlog, 4 to 32 texts; no timer; two
                 workers, so two model runs at once);
  batcher/1 worker  the same with one model run at a time (the default before two);
  take-all/32    the worker takes everything queued, up to 32 (the GPU policy), to
                 show what big groups cost the tail on a CPU;
  batcher+wait2  the defaults with max_wait_ms=2, to show what a fill timer costs on a CPU.
The modes take turns in ROUNDS rounds of SECONDS each per concurrency, and each row
pools its rounds, so that other load on the machine falls on every mode alike.

Reports texts/s, p50/p99 latency per request (from embed() called to vector back), and
the process RSS after load and at its peak under load. Prints a table, writes
reports/embed.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.report import ROOT, rss_mb, table, write
from sidecar.embedding.batcher import Batcher
from sidecar.embedding.loader import load
from sidecar.embedding.settings import EmbeddingSettings

CONCURRENCY = (1, 8, 32, 128)
# Batcher modes: (max_wait_ms, take all up to max_batch); None = the settings' default.
# workers: model runs at once (None = the settings' default).
MODES = {"one-at-a-time": None, "batcher": (None, False, None), "batcher/1 worker": (None, False, 1),
         "take-all/32": (None, True, None), "batcher+wait2": (2.0, False, None)}
THREADS = (1, 2)
ROUNDS = 3
SECONDS = 1.2
PROMPTS = 6000


def paraphrase_path() -> Path:
    return Path(os.environ.get("SLUICE_PARAPHRASE", ROOT.parent / "shared" / "data" / "paraphrase" / "dev.jsonl"))


def load_prompts(path: Path, count: int) -> list[str]:
    texts: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            texts += [row["a"], row["b"]]
            if len(texts) >= count:
                break
    random.Random(7).shuffle(texts)
    return texts


class RssPeak:
    """Samples this process's RSS every 50 ms while the load runs."""

    def __init__(self):
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mb(os.getpid()))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


async def closed_loop(embed, texts: list[str], clients: int, seconds: float, offset: int) -> dict:
    latencies: list[float] = []
    cursor = iter(range(offset, 10**9))
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < deadline:
            text = texts[next(cursor) % len(texts)]
            started = time.perf_counter()
            await embed(text)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {"latencies": latencies, "elapsed": time.perf_counter() - started}


async def run_cell(model, mode: str, clients: int, texts: list[str], seconds: float,
                   offset: int) -> dict:
    if mode == "one-at-a-time":
        worker = ThreadPoolExecutor(max_workers=1)
        loop = asyncio.get_running_loop()
        encoder = model.encoder

        async def embed(text):  # one model run per text, never on the loop
            return await loop.run_in_executor(worker, lambda: encoder.run([encoder.tokenize(text)])[0])
        try:
            return await closed_loop(embed, texts, clients, seconds, offset)
        finally:
            worker.shutdown()
    wait_ms, take_all, workers = MODES[mode]
    settings = EmbeddingSettings.from_env(max_wait_ms=wait_ms, workers=workers)
    batcher = Batcher(model.encoder.encode_iter, max_batch=model.encoder.max_batch,
                      min_group=None if take_all else settings.min_group(on_gpu=False),
                      workers=settings.worker_count(on_gpu=False),
                      max_wait_s=settings.max_wait_s, max_queue=1024)
    try:
        return await closed_loop(batcher.embed, texts, clients, seconds, offset)
    finally:
        await batcher.close()


def summarize(cells: list[dict]) -> dict:
    latencies = sorted(x for cell in cells for x in cell["latencies"])
    return {"texts_per_s": len(latencies) / sum(cell["elapsed"] for cell in cells),
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "requests": len(latencies)}


def through_envoy(texts: list[str], seconds: float) -> list[dict]:
    """The same prompts as chat requests through Envoy and the sidecar, each one new (so each is
    embedded once and misses), on a cache route and on a cache-off route, at each concurrency:
    requests/s and latency; the difference is the embedding in the request path."""
    import pathlib
    import tempfile

    import httpx

    from devtools.envoy_config import chat_route
    from devtools.stack import Stack

    cached = chat_route("cached", "/", [{"cluster": "upstream_a"}])
    plain = chat_route("plain", "/plain/", [{"cluster": "upstream_a"}], rewrite="/")
    plain["metadata"]["filter_metadata"]["sluice"]["cache"] = {"enabled": False}
    fast = ["--ttft-ms", "0", "--tokens", "1", "--tokens-per-s", "1000000"]
    rows = []

    async def cell(url: str, clients: int) -> dict:
        nonce = iter(range(10**9))
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            async def ask(text: str) -> None:
                body = {"model": "demo-model", "messages": [{"role": "user", "content": f"{text} ({next(nonce)})"}]}
                response = await client.post(url, json=body, headers={"authorization": "Bearer bench"})
                response.raise_for_status()
            return await closed_loop(ask, texts, clients, seconds, clients * 7)

    with tempfile.TemporaryDirectory() as tmp, Stack(
            pathlib.Path(tmp), routes=[plain, cached], upstream_args={"a": fast, "b": fast},
            envoy_vars={"RATE_LIMIT_TOKENS": 100_000_000}, sidecar_env={"SLUICE_CACHE": "true"}) as stack:
        for clients in CONCURRENCY:
            for route, prefix in (("cache on (embeds)", "/"), ("cache off", "/plain/")):
                url = f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions"
                row = {"route": route, "clients": clients, **summarize([asyncio.run(cell(url, clients))])}
                rows.append(row)
                print(f"  envoy {route:18} clients={clients:3} {row['texts_per_s']:7.1f} req/s  "
                      f"p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help="per cell")
    parser.add_argument("--threads", default=",".join(map(str, THREADS)),
                        help="onnxruntime intra-op thread counts to compare")
    parser.add_argument("--no-envoy", action="store_true", help="skip the end-to-end part")
    args = parser.parse_args(argv)
    texts = load_prompts(paraphrase_path(), PROMPTS)
    rss_start = rss_mb(os.getpid())
    load_at_start = os.getloadavg()  # other work on the box skews every figure
    rows, loads = [], []
    for threads in (int(t) for t in args.threads.split(",")):
        settings = EmbeddingSettings.from_env(provider="cpu", intra_op_threads=threads)
        started = time.perf_counter()
        model = load(settings)
        loads.append({"intra_op_threads": threads, "load_s": round(time.perf_counter() - started, 2),
                      "rss_after_load_mb": round(rss_mb(os.getpid()), 1),
                      "run_overhead_tokens": round(model.encoder.run_overhead_tokens, 1)})
        with RssPeak() as rss:
            for clients in CONCURRENCY:
                # Modes take turns, round after round, so that load from elsewhere on the
                # machine falls on all of them alike.
                cells: dict[str, list[dict]] = {mode: [] for mode in MODES}
                for round_ in range(ROUNDS):
                    for number, mode in enumerate(MODES):
                        offset = 997 * (round_ * len(MODES) + number)
                        cells[mode].append(asyncio.run(
                            run_cell(model, mode, clients, texts, args.seconds, offset)))
                for mode, runs in cells.items():
                    row = {"threads": threads, "clients": clients, "mode": mode, **summarize(runs)}
                    rows.append(row)
                    print(f"  threads={threads} clients={clients:3} {mode:16} "
                          f"{row['texts_per_s']:7.1f} texts/s  p50 {row['p50_ms']:7.2f} ms  "
                          f"p99 {row['p99_ms']:7.2f} ms", flush=True)
        loads[-1]["rss_peak_under_load_mb"] = round(rss.peak, 1)
        del model
    print()
    print(table(rows, ["threads", "clients", "mode", "texts_per_s", "p50_ms", "p99_ms"]))
    print()
    print(table(loads, list(loads[0])))
    envoy_rows = [] if args.no_envoy else through_envoy(texts, max(4.0, args.seconds))
    if envoy_rows:
        print()
        print(table(envoy_rows, ["route", "clients", "texts_per_s", "p50_ms", "p99_ms"]))
    tokens = [len(t) for t in texts]
    path = write("embed", {
        "workload": {"source": str(paraphrase_path()), "prompts": len(texts),
                     "mean_chars": round(statistics.mean(tokens), 1), "seconds_per_cell": args.seconds, "rounds": ROUNDS},
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
        "rss_start_mb": round(rss_start, 1),
        "loads": loads, "rows": rows, "through_envoy": envoy_rows})
    print(f"\nwrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
