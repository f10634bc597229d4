"""`make bench-route`: Sluice's scheduler against Envoy's round robin over the same three clusters.

Three demo clusters: a fast; b slow with a long tail; c that degrades under load (2 slots, each
running request slows the others). An open-loop Poisson arrival rate for a fixed duration per
phase, in one run: round robin (Envoy weighted_clusters, equal weights; the sidecar still runs but
does not steer) and Sluice, first with every cluster healthy, then with cluster c failing every
request. Reports mean/P50/P99 latency, error rate and the standard deviation across clusters of
their mean load (in-flight + queued, over capacity), printed and in reports/route.json.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import tempfile

import httpx

from bench import report
from bench.openloop import open_loop, percentile
from devtools.envoy_config import chat_route
from devtools.stack import Stack

CLUSTERS = {  # name -> (demo upstream flags, capacity used to normalise load)
    "a": (["--ttft-ms", "60", "--tokens", "20", "--tokens-per-s", "400", "--capacity", "16"], 16),
    "b": (["--ttft-ms", "250", "--tokens", "20", "--tokens-per-s", "200", "--capacity", "16",
           "--tail-rate", "0.1", "--tail-factor", "8"], 16),
    "c": (["--ttft-ms", "80", "--tokens", "20", "--tokens-per-s", "300", "--capacity", "2",
           "--slowdown-per-running", "1.0"], 2),
}
BREAKER = {"window_s": 10, "min_requests": 5, "max_error_ratio": 0.3, "cooldown_s": 10}
BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "Summarise the release notes."}]}


def routes() -> list[dict]:
    clusters = [{"cluster": f"upstream_{n}"} for n in CLUSTERS]
    sluice = chat_route("sluice", "/sluice/", clusters, rewrite="/")
    sluice["metadata"]["filter_metadata"]["sluice"]["scheduling"] = {"breaker": BREAKER}
    round_robin = {"name": "round_robin", "match": {"prefix": "/rr/"},
                   "route": {"prefix_rewrite": "/", "timeout": "30s", "weighted_clusters": {
                       "clusters": [{"name": f"upstream_{n}", "weight": 1} for n in CLUSTERS]}},
                   "metadata": {"filter_metadata": {"sluice": {"name": "round_robin"}}}}
    return [sluice, round_robin]


async def sample_load(stack: Stack, stop: asyncio.Event, samples: dict[str, list[float]]) -> None:
    async with httpx.AsyncClient(timeout=2) as client:
        while not stop.is_set():
            for name, (_, capacity) in CLUSTERS.items():
                stats = (await client.get(f"http://127.0.0.1:{stack.upstream_port(name)}/admin/stats")).json()
                samples[name].append((stats["running"] + stats["waiting"]) / capacity)
            await asyncio.sleep(0.25)


async def phase(stack: Stack, prefix: str, rate: float, seconds: float, seed: int) -> dict:
    url = f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions"
    samples = {name: [] for name in CLUSTERS}
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        async def one(i: int) -> dict:
            try:
                response = await client.post(url, json=BODY, headers={"authorization": "Bearer bench"})
                return {"ok": response.status_code == 200, "cluster": response.headers.get("x-upstream-name", "none")}
            except httpx.HTTPError:
                return {"ok": False, "cluster": "none"}

        sampler = asyncio.create_task(sample_load(stack, stop, samples))
        results = await open_loop(rate, seconds, seed, one)
        stop.set()
        await sampler
    ms = [r["latency_s"] * 1000 for r in results]
    per_cluster: dict[str, int] = {}
    for r in results:
        per_cluster[r["cluster"]] = per_cluster.get(r["cluster"], 0) + 1
    mean_load = {n: statistics.fmean(s) if s else 0.0 for n, s in samples.items()}
    return {"requests": len(ms), "mean_ms": statistics.fmean(ms), "p50_ms": percentile(ms, 0.5),
            "p99_ms": percentile(ms, 0.99), "error_rate": sum(not r["ok"] for r in results) / len(ms),
            "load_std": statistics.pstdev(mean_load.values()), "mean_load": mean_load,
            "per_cluster": per_cluster}


async def set_failing(stack: Stack, name: str, rate: float) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(f"http://127.0.0.1:{stack.upstream_port(name)}/admin/config", json={"error_rate": rate})


async def run(stack: Stack, rate: float, seconds: float) -> dict:
    results: dict = {}
    for prefix, arm in (("/rr/", "round_robin"), ("/sluice/", "sluice")):
        results[arm] = await phase(stack, prefix, rate, seconds, seed=1)
    await set_failing(stack, "c", 1.0)
    results["failing"] = {}
    for prefix, arm in (("/rr/", "round_robin"), ("/sluice/", "sluice")):
        results["failing"][arm] = await phase(stack, prefix, rate, seconds, seed=2)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=30.0, help="arrivals per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each phase")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(pathlib.Path(tmp), routes=routes(), extra_upstreams=("c",),
                      upstream_args={n: flags for n, (flags, _) in CLUSTERS.items()},
                      envoy_vars={"RATE_LIMIT_TOKENS": 100_000},
                      sidecar_env={"SLUICE_CACHE": "false"})   # one prompt repeated: the cache would answer it
        with stack:
            results = asyncio.run(run(stack, args.rate, args.seconds))
    rows = []
    for phase_name, arms in (("healthy", results), ("c failing", results["failing"])):
        for arm in ("round_robin", "sluice"):
            r = arms[arm]
            rows.append({"phase": phase_name, "router": arm, "requests": r["requests"],
                         "mean ms": r["mean_ms"], "p50 ms": r["p50_ms"], "p99 ms": r["p99_ms"],
                         "errors %": 100 * r["error_rate"], "load std": r["load_std"],
                         "a/b/c": "/".join(str(r["per_cluster"].get(n, 0)) for n in CLUSTERS)})
    print(f"open loop {args.rate:g} req/s, {args.seconds:g} s per phase; breaker {BREAKER}")
    print(report.table(rows, ["phase", "router", "requests", "mean ms", "p50 ms", "p99 ms", "errors %",
                              "load std", "a/b/c"]))
    for phase_name, arms in (("healthy", results), ("failing", results["failing"])):
        rr, sl = arms["round_robin"], arms["sluice"]
        print(f"{phase_name}: P99 {rr['p99_ms']:.0f} -> {sl['p99_ms']:.0f} ms "
              f"({100 * (1 - sl['p99_ms'] / rr['p99_ms']):.0f}% lower), errors "
              f"{100 * rr['error_rate']:.1f}% -> {100 * sl['error_rate']:.1f}%")
    keys = ("mean_ms", "p50_ms", "p99_ms", "error_rate", "load_std")
    out = {arm: {k: results[arm][k] for k in keys} for arm in ("round_robin", "sluice")}
    out["failing"] = {arm: {k: results["failing"][arm][k] for k in keys} for arm in ("round_robin", "sluice")}
    out["details"] = results
    out["settings"] = {"rate": args.rate, "seconds": args.seconds, "breaker": BREAKER,
                       "clusters": {n: flags for n, (flags, _) in CLUSTERS.items()}}
    print(f"wrote {report.write('route', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
