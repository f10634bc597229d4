"""`make bench` / `make bench-overhead`: what the sidecar costs on the request path.

Four set-ups in one run, each with wrk at concurrency 1, 16 and 64, a ~2 KB chat body:
  upstream   the demo upstream directly
  envoy      Envoy without the ext_proc filter
  noop       Envoy + a sidecar that changes nothing (request headers, buffered body, response headers)
  sluice     Envoy + Sluice's routing path (parse the chat body, score and pick a cluster, set the
             cluster and timeout headers); the cache is off here (wrk repeats one body, which
             would be all exact hits: `make bench-cache` measures those)
The two sidecars run side by side and take turns at each concurrency (`--rounds` turns each,
the median kept): on a shared 2-core machine a minute's drift moves req/s by 20-30%, which
measuring one set-up after the other put into the ratio.
Prints a table and writes reports/overhead.json with req/s, p50/p90/p99 and the sidecar's RSS.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import tempfile

from bench import report, turns, wrk
from devtools import envoy_config
from devtools.envoy_config import chat_route
from devtools.stack import Stack

CONCURRENCY = (1, 16, 64)
FAST_UPSTREAM = ["--ttft-ms", "0", "--tokens", "1", "--tokens-per-s", "1000000"]
FAST_UPSTREAMS = {"a": FAST_UPSTREAM, "b": FAST_UPSTREAM}
NO_RATE_LIMIT = {"RATE_LIMIT_TOKENS": 100_000_000}   # the benchmark measures cost, not the limit


def chat_body(size: int = 2048) -> bytes:
    messages = [{"role": "system", "content": "You are a concise assistant for a support desk."},
                {"role": "user", "content": ""}]
    base = {"model": "demo-model", "messages": messages, "temperature": 0.2, "max_tokens": 64}
    filler = size - len(json.dumps(base))
    messages[1]["content"] = ("How do I reset my password when the reset link has expired? " * 40)[:filler]
    return json.dumps(base).encode()


class NoExtProcStack(Stack):
    """Envoy with the ext_proc filter removed: routes straight to the default cluster."""

    def write_envoy_config(self) -> pathlib.Path:
        path = super().write_envoy_config()
        config = envoy_config.yaml.safe_load(path.read_text())
        for hcm in envoy_config.http_connection_managers(config):
            hcm["http_filters"] = [f for f in hcm["http_filters"]
                                   if f["name"] != "envoy.filters.http.ext_proc"]
        return envoy_config.write(config, path)


def bench_stack(workdir: pathlib.Path, sidecar_args: list[str], sidecar_env: dict | None = None) -> Stack:
    """Envoy + a sidecar with one candidate, so every request goes to the same fast upstream
    process (ttft 0, one token): the set-up the no-op and Sluice are compared in."""
    routes = [chat_route("bench", "/", [{"cluster": "upstream_a", "weight": 1}])]
    return Stack(workdir, upstream_args=FAST_UPSTREAMS, sidecar_args=sidecar_args,
                 envoy_vars=NO_RATE_LIMIT, routes=routes, sidecar_env=sidecar_env)


def measure(url: str, body: bytes, seconds: float) -> list[dict]:
    wrk.run(url, body, 16, 1)   # warm-up: connections, caches, JIT-free but lazy imports
    return [{"concurrency": c, **wrk.run(url, body, c, seconds)} for c in CONCURRENCY]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="wrk duration per point")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each sidecar per concurrency")
    args = parser.parse_args()
    body = chat_body()
    results: dict[str, list[dict]] = {}
    rss: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        with NoExtProcStack(work / "envoy", upstream_args=FAST_UPSTREAMS, with_sidecar=False,
                            envoy_vars=NO_RATE_LIMIT) as stack:
            results["upstream"] = measure(
                f"http://127.0.0.1:{stack.ports.upstream_a}/v1/chat/completions", body, args.seconds)
            results["envoy"] = measure(f"{stack.base_url}/chat/completions", body, args.seconds)
        with contextlib.ExitStack() as running:
            stacks = {name: running.enter_context(bench_stack(work / name, extra, {"SLUICE_CACHE": "false"}))
                      for name, extra in (("noop", ["--noop"]), ("sluice", []))}
            pids = {name: stack.procs["sidecar"].pid for name, stack in stacks.items()}
            start_rss = {name: report.rss_mb(pid) for name, pid in pids.items()}
            urls = {name: f"{stack.base_url}/chat/completions" for name, stack in stacks.items()}
            for url in urls.values():
                wrk.run(url, body, 16, 1)       # warm-up
            results.update(turns.in_turns(
                {name: lambda c, url=url: wrk.run(url, body, c, args.seconds) for name, url in urls.items()},
                CONCURRENCY, args.rounds))
            rss = {name: {"start_mb": start_rss[name], "after_load_mb": report.rss_mb(pid)}
                   for name, pid in pids.items()}

    rows = [{"setup": name, "concurrency": r["concurrency"], "req/s": r["rps"], "p50 ms": r["p50_ms"],
             "p90 ms": r["p90_ms"], "p99 ms": r["p99_ms"], "errors": r["errors"]}
            for name, points in results.items() for r in points]
    print(f"body {len(body)} bytes, {args.seconds:.0f} s per point, wrk 1 thread; "
          f"noop and sluice: median of {args.rounds} turns")
    print(report.table(rows, ["setup", "concurrency", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors"]))
    ratios = {str(c): turns.ratio(results["sluice"][i], results["noop"][i]) for i, c in enumerate(CONCURRENCY)}
    added_p50 = results["sluice"][0]["p50_ms"] - results["envoy"][0]["p50_ms"]
    print("\nsluice/noop throughput: " + ", ".join(f"c={c}: {r:.2f}" for c, r in ratios.items()))
    print(f"p50 added by the sidecar at concurrency 1: {added_p50:.2f} ms")
    print("sidecar RSS MiB: " + ", ".join(f"{n}: start {v['start_mb']:.0f}, after load {v['after_load_mb']:.0f}"
                                        for n, v in rss.items()))
    path = report.write("overhead", {"body_bytes": len(body), "seconds_per_point": args.seconds, "rounds": args.rounds,
                                     "results": results, "sluice_over_noop_rps": ratios,
                                     "sidecar_added_p50_ms_c1": added_p50, "sidecar_rss": rss})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
