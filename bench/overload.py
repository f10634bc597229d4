"""`make bench-overload`: a capacity-limited cluster at 3x its capacity, straight through Envoy
and through the Sluice gate, in one run.

The demo upstream serves `SLOTS` requests at once (more wait in its FIFO, like a full GPU
batch); each client gives up after its deadline. 10% of the traffic is VIP. Reports per class
P50/P99 latency of answers, goodput (answers within the deadline per second), refusals and
wasted upstream work (requests the upstream queued or ran for a client that had already left),
printed and in reports/overload.json. A last phase sends only the same VIP arrivals: their P99
there is the floor any admission policy can reach on this cluster.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import tempfile

import httpx

from bench import report
from bench.openloop import open_loop, percentile
from devtools.envoy_config import chat_route
from devtools.stack import Stack

SLOTS, TTFT_MS, TOKENS, TOKENS_PER_S = 4, 200, 20, 100
SERVICE_S = TTFT_MS / 1000 + TOKENS / TOKENS_PER_S          # 0.4 s per request alone
CAPACITY_RPS = SLOTS / SERVICE_S
DEADLINE_S = 3.0
VIP_SHARE = 0.1
BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "Plan my week."}]}


def routes() -> list[dict]:
    def gated(name: str, prefix: str, priority: str) -> dict:
        route = chat_route(name, prefix, [{"cluster": "upstream_a", "max_in_flight": SLOTS}], rewrite="/")
        route["metadata"]["filter_metadata"]["sluice"]["admission"] = {
            "enabled": True, "default_priority": priority, "default_deadline_s": DEADLINE_S}
        return route
    direct = {"name": "direct", "match": {"prefix": "/direct/"},
              "route": {"cluster": "upstream_a", "prefix_rewrite": "/", "timeout": "30s"},
              "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
                  "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                  "disabled": True}}}
    return [gated("gate_vip", "/gate-vip/", "vip"), gated("gate", "/gate/", "standard"), direct]


async def upstream_stats(client: httpx.AsyncClient, port: int, reset: bool = False) -> dict:
    if reset:
        await client.post(f"http://127.0.0.1:{port}/admin/reset-stats")
    return (await client.get(f"http://127.0.0.1:{port}/admin/stats")).json()


async def phase(stack: Stack, arm: str, rate: float, seconds: float, seed: int, vip_only: bool = False) -> dict:
    """One arm's open loop; vip_only sends just the VIP requests of the same arrivals."""
    rng = random.Random(seed + 1)
    vip = [rng.random() < VIP_SHARE for _ in range(int(rate * seconds * 2) + 10)]
    port = stack.upstream_port("a")
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=500)
    async with httpx.AsyncClient(timeout=DEADLINE_S, limits=limits) as client:
        await upstream_stats(client, port, reset=True)

        async def one(i: int) -> dict:
            cls = "vip" if vip[i] else "standard"
            if vip_only and not vip[i]:
                return {"class": cls, "status": "not_sent"}
            prefix = "/direct/" if arm == "direct" else ("/gate-vip/" if vip[i] else "/gate/")
            try:
                response = await client.post(
                    f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions", json=BODY,
                    headers={"authorization": f"Bearer tenant{i % 20}",
                             "x-request-deadline-ms": str(int(DEADLINE_S * 1000))})
                return {"class": cls, "status": response.status_code}
            except httpx.TimeoutException:
                return {"class": cls, "status": "gave_up"}
            except httpx.HTTPError:
                return {"class": cls, "status": "error"}

        results = await open_loop(rate, seconds, seed, one)
        await asyncio.sleep(1.0)                  # let the upstream notice the last departures
        upstream = await upstream_stats(client, port)
    out: dict = {"requests": len(results)}
    for cls in ("vip", "standard"):
        mine = [r for r in results if r["class"] == cls]
        answered = [r["latency_s"] * 1000 for r in mine if r["status"] == 200]
        out[cls] = {"requests": len(mine), "answered": len(answered),
                    "p50_ms": percentile(answered, 0.5), "p99_ms": percentile(answered, 0.99),
                    "refused": sum(r["status"] in (429, 503) for r in mine),
                    "gave_up": sum(r["status"] == "gave_up" for r in mine)}
    good = [r for r in results if r["status"] == 200 and r["latency_s"] <= DEADLINE_S]
    out["goodput_rps"] = len(good) / seconds
    out["refused"] = sum(r["status"] in (429, 503) for r in results)
    out["wasted"] = upstream["disconnected"]
    out["upstream"] = upstream
    out["refusal_reasons"] = refusal_reasons(stack)
    return out


def refusal_reasons(stack: Stack) -> dict[str, float]:
    """Cumulative admission refusals by reason, from the sidecar's metrics."""
    import re
    text = httpx.get(f"http://127.0.0.1:{stack.ports.metrics}/metrics").text
    reasons: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sluice_admission_requests_refused_total{"):
            reason = re.search(r'reason="([^"]*)"', line).group(1)
            reasons[reason] = reasons.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    return reasons


async def run(stack: Stack, seconds: float) -> dict:
    unloaded = await phase(stack, "gate", CAPACITY_RPS * 0.2, min(seconds, 15), seed=1)
    direct = await phase(stack, "direct", CAPACITY_RPS * 3, seconds, seed=2)
    gate = await phase(stack, "gate", CAPACITY_RPS * 3, seconds, seed=2)
    # The floor: the same VIP arrivals with no other traffic at all. Poisson arrivals bunch:
    # where more VIPs arrive within one service time than the cluster has slots, some wait
    # whatever the admission policy.
    vip_alone = await phase(stack, "gate", CAPACITY_RPS * 3, seconds, seed=2, vip_only=True)
    return {"unloaded": unloaded, "direct": direct, "gate": gate, "vip_alone": vip_alone}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each loaded phase")
    parser.add_argument("--reserved-slots", type=int, default=0,
                        help="slots per cluster only VIP may take (SLUICE_ADMISSION_RESERVED_SLOTS)")
    args = parser.parse_args()
    upstream = ["--ttft-ms", str(TTFT_MS), "--tokens", str(TOKENS), "--tokens-per-s", str(TOKENS_PER_S),
                "--capacity", str(SLOTS)]
    with tempfile.TemporaryDirectory() as tmp:
        # The cache is off: every request is the same prompt and must reach the upstream.
        with Stack(pathlib.Path(tmp), routes=routes(), upstream_args={"a": upstream, "b": []},
                   envoy_vars={"RATE_LIMIT_TOKENS": 100_000},
                   sidecar_env={"SLUICE_CACHE": "false",
                                "SLUICE_ADMISSION_RESERVED_SLOTS": str(args.reserved_slots)}) as stack:
            results = asyncio.run(run(stack, args.seconds))
    rows = []
    for arm in ("direct", "gate"):
        r = results[arm]
        for cls in ("vip", "standard"):
            c = r[cls]
            rows.append({"arm": arm, "class": cls, "requests": c["requests"], "answered": c["answered"],
                         "p50 ms": c["p50_ms"], "p99 ms": c["p99_ms"], "refused": c["refused"],
                         "gave up": c["gave_up"]})
    print(f"capacity {CAPACITY_RPS:.1f} req/s ({SLOTS} slots x {SERVICE_S:.2f} s), arrivals 3x for "
          f"{args.seconds:g} s, {VIP_SHARE:.0%} VIP, client deadline {DEADLINE_S:g} s")
    print(report.table(rows, ["arm", "class", "requests", "answered", "p50 ms", "p99 ms", "refused", "gave up"]))
    vip_unloaded = results["unloaded"]["vip"]["p99_ms"]
    for arm in ("direct", "gate"):
        r = results[arm]
        print(f"{arm}: goodput {r['goodput_rps']:.1f} req/s ({r['goodput_rps'] / CAPACITY_RPS:.0%} of capacity), "
              f"VIP p99 {r['vip']['p99_ms']:.0f} ms ({r['vip']['p99_ms'] / vip_unloaded:.2f}x unloaded "
              f"{vip_unloaded:.0f} ms), refused {r['refused']}, wasted upstream work {r['wasted']}")
    alone = results["vip_alone"]["vip"]["p99_ms"]
    print(f"the same VIP arrivals alone: VIP p99 {alone:.0f} ms ({alone / vip_unloaded:.2f}x unloaded), the floor "
          f"for any admission policy")
    print(f"gate refusals by reason (cumulative): {results['gate']['refusal_reasons']}")
    keys = ("p50_ms", "p99_ms")
    out = {"capacity_rps": CAPACITY_RPS, "reserved_slots": args.reserved_slots,
           "unloaded": {"vip_p99_ms": vip_unloaded}, "vip_alone": {"vip_p99_ms": alone}}
    for arm in ("direct", "gate"):
        r = results[arm]
        out[arm] = {"vip": {k: r["vip"][k] for k in keys}, "standard": {k: r["standard"][k] for k in keys},
                    "goodput_rps": r["goodput_rps"], "refused": r["refused"], "wasted": r["wasted"]}
    out["details"] = results
    print(f"wrote {report.write('overload', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
