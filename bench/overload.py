"""`make bench-overload`: a capacity-limited cluster at 3x its capacity, three arms side by side
in one run: straight through Envoy (direct), through the Sluice gate (gate), and through the
gate to an engine that schedules by priority and preempts (gate + engine priority).

The demo upstream serves `SLOTS` requests at once (more wait in its queue, like a full GPU
batch); each client gives up after its deadline. 10% of the traffic is VIP. Upstream a runs
first come first served; upstream b, the same engine, runs vLLM's priority scheduling (the
sidecar writes each request's class into the body's `priority`). Reports per class P50/P99
latency of answers, goodput (answers within the deadline per second), refusals, wasted
upstream work (requests the upstream queued or ran for a client that had already left) and
preemptions, printed and in reports/overload.json.

Goals (issue 19), each checked in the same run: VIP P99 under overload <= 1.25x the P99 of the
same VIP arrivals with no other traffic (the floor of any policy that does not preempt; the
phase `vip_alone`), goodput >= 95% of capacity, no wasted work, and standard goodput >= 80% of
what capacity is left after VIP's. The ratio to the unloaded VIP P99 is reported as well.

A phase measures tenant fairness on the gate: one tenant sends 10x as much as each of 9
others, together 3x capacity; the others' share of goodput against their fair share.

A last phase measures cost-aware admission (`admission.count_tokens`) on an engine whose batch
is bounded in tokens (the demo upstream's kv_tokens, as TGI's max_batch_total_tokens): 10% of
the requests are ~8k tokens (a long prompt), 90% ~100 tokens, at 1.5x the engine's capacity in
tokens, with count_tokens off and on (each on its own upstream, same arrivals). Reported: goodput
in tokens per second (prompt + completion tokens of answers within the deadline), the small
requests' P50/P99 and goodput, the large ones answered, refusals and wasted work. The issue sets
no goal for it: the figures are reported.
"""
from __future__ import annotations

import argparse
import asyncio
import os
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
# arm -> (upstream, path prefix of VIP requests, of standard ones)
ARMS = {"direct": ("a", "/direct/", "/direct/"), "gate": ("a", "/gate-vip/", "/gate/"),
        "engine_priority": ("b", "/prio-vip/", "/prio/")}
ARM_TITLES = {"direct": "direct", "gate": "gate", "engine_priority": "gate + engine priority"}
HEAVY_FACTOR, LIGHT_TENANTS = 10, 9
# Cost phase: an engine with room for KV_TOKENS tokens at once (no limit in requests), each
# request ~1 s (first token 0.5 s, 100 tokens at 200/s).
KV_TOKENS, COST_TTFT_MS, COST_TOKENS, COST_TOKENS_PER_S = 16_000, 500, 100, 200
COST_SERVICE_S = COST_TTFT_MS / 1000 + COST_TOKENS / COST_TOKENS_PER_S
LARGE_SHARE, LARGE_PROMPT_TOKENS = 0.1, 7_800
SMALL_TOKENS = 100                                   # 3 prompt tokens + 100 of answer, near enough
MEAN_TOKENS = LARGE_SHARE * (LARGE_PROMPT_TOKENS + COST_TOKENS) + (1 - LARGE_SHARE) * SMALL_TOKENS
COST_CAPACITY_RPS = KV_TOKENS / MEAN_TOKENS / COST_SERVICE_S
# The gate's limit in requests: the engine's room at the mean request (what counting requests
# has to go by); with count_tokens on its slots count in units of the mean expected cost.
COST_MAX_IN_FLIGHT = round(KV_TOKENS / MEAN_TOKENS)
COST_ARMS = {"count_tokens_off": ("c", "/cost-off/", False), "count_tokens_on": ("d", "/cost-on/", True)}


def routes() -> list[dict]:
    def gated(name: str, prefix: str, priority: str, cluster: str = "upstream_a", **candidate) -> dict:
        route = chat_route(name, prefix, [{"cluster": cluster, "max_in_flight": SLOTS, **candidate}], rewrite="/")
        route["metadata"]["filter_metadata"]["sluice"]["admission"] = {
            "enabled": True, "default_priority": priority, "default_deadline_s": DEADLINE_S}
        return route
    direct = {"name": "direct", "match": {"prefix": "/direct/"},
              "route": {"cluster": "upstream_a", "prefix_rewrite": "/", "timeout": "30s"},
              "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
                  "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                  "disabled": True}}}
    engine = {"engine_priority": {"kind": "vllm"}}
    cost = []
    for name, (upstream, prefix, count_tokens) in COST_ARMS.items():
        route = chat_route(name, prefix, [{"cluster": f"upstream_{upstream}", "max_in_flight": COST_MAX_IN_FLIGHT}],
                           rewrite="/")
        route["metadata"]["filter_metadata"]["sluice"]["admission"] = {
            "enabled": True, "default_priority": "standard", "default_deadline_s": DEADLINE_S,
            "count_tokens": count_tokens}
        cost.append(route)
    return [gated("gate_vip", "/gate-vip/", "vip"), gated("gate", "/gate/", "standard"),
            gated("prio_vip", "/prio-vip/", "vip", "upstream_b", **engine),
            gated("prio", "/prio/", "standard", "upstream_b", **engine), *cost, direct]


def open_loop_client() -> httpx.AsyncClient:
    """A client that gives up after the deadline, with room for every request of an open loop."""
    return httpx.AsyncClient(timeout=DEADLINE_S, limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500))


async def upstream_stats(client: httpx.AsyncClient, port: int, reset: bool = False) -> dict:
    if reset:
        await client.post(f"http://127.0.0.1:{port}/admin/reset-stats")
    return (await client.get(f"http://127.0.0.1:{port}/admin/stats")).json()


async def phase(stack: Stack, arm: str, rate: float, seconds: float, seed: int, vip_only: bool = False,
                tenants: bool = False) -> dict:
    """One arm's open loop; vip_only sends just the VIP requests of the same arrivals; tenants
    sends standard requests only, from one heavy tenant and LIGHT_TENANTS light ones."""
    rng = random.Random(seed + 1)
    n = int(rate * seconds * 2) + 10
    vip = [rng.random() < VIP_SHARE and not tenants for _ in range(n)]
    heavy_share = HEAVY_FACTOR / (HEAVY_FACTOR + LIGHT_TENANTS)
    tenant = [("heavy" if rng.random() < heavy_share else f"light{rng.randrange(LIGHT_TENANTS)}") if tenants
              else f"tenant{i % 20}" for i in range(n)]
    name, vip_prefix, standard_prefix = ARMS[arm]
    port = stack.upstream_port(name)
    async with open_loop_client() as client:
        await upstream_stats(client, port, reset=True)

        async def one(i: int) -> dict:
            cls = "vip" if vip[i] else "standard"
            if vip_only and not vip[i]:
                return {"class": cls, "status": "not_sent"}
            prefix = vip_prefix if vip[i] else standard_prefix
            out = {"class": cls, "tenant": tenant[i]}
            try:
                response = await client.post(
                    f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions", json=BODY,
                    headers={"authorization": f"Bearer {tenant[i]}",
                             "x-request-deadline-ms": str(int(DEADLINE_S * 1000))})
                return {**out, "status": response.status_code}
            except httpx.TimeoutException:
                return {**out, "status": "gave_up"}
            except httpx.HTTPError:
                return {**out, "status": "error"}

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
    out["vip"]["goodput_rps"] = sum(r["class"] == "vip" for r in good) / seconds
    out["standard"]["goodput_rps"] = sum(r["class"] == "standard" for r in good) / seconds
    out["wasted"] = upstream["disconnected"]
    out["wasted_detail"] = upstream.get("disconnects", [])   # the last ones: time held upstream, preemptions
    out["preempted"] = upstream.get("preempted", 0)
    if tenants:
        out["tenant_goodput_rps"] = {t: sum(r.get("tenant") == t for r in good) / seconds for t in sorted(set(tenant))}
    out["upstream"] = upstream
    out.update(sidecar_metrics(stack))
    out["load_average_1m"] = os.getloadavg()[0]   # a shared machine's other work skews latencies
    return out


def large_prompt(rng: random.Random) -> str:
    """~LARGE_PROMPT_TOKENS tokens (4 characters each) of varied words."""
    words = ("budget", "review", "plan", "meeting", "draft", "report", "quarter", "summary", "notes", "team")
    text, size = [], 0
    while size < LARGE_PROMPT_TOKENS * 4:
        text.append(rng.choice(words))
        size += len(text[-1]) + 1
    return " ".join(text)


async def cost_phase(stack: Stack, arm: str, rate: float, seconds: float, seed: int) -> dict:
    """Mixed sizes at `rate`: LARGE_SHARE long-prompt requests, the rest short; both ask
    COST_TOKENS of answer."""
    upstream_name, prefix, _ = COST_ARMS[arm]
    rng = random.Random(seed + 1)
    n = int(rate * seconds * 2) + 10
    large = [rng.random() < LARGE_SHARE for _ in range(n)]
    prompt = large_prompt(rng)
    port = stack.upstream_port(upstream_name)
    async with open_loop_client() as client:
        await upstream_stats(client, port, reset=True)

        async def one(i: int) -> dict:
            size = "large" if large[i] else "small"
            content = f"{i} {prompt}" if large[i] else f"{i} Plan my week."
            body = {"model": "demo-model", "max_tokens": COST_TOKENS, "messages": [{"role": "user", "content": content}]}
            try:
                response = await client.post(
                    f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions", json=body,
                    headers={"authorization": f"Bearer tenant{i % 20}",
                             "x-request-deadline-ms": str(int(DEADLINE_S * 1000))})
            except httpx.TimeoutException:
                return {"size": size, "status": "gave_up"}
            except httpx.HTTPError:
                return {"size": size, "status": "error"}
            tokens = response.json().get("usage", {}).get("total_tokens", 0) if response.status_code == 200 else 0
            return {"size": size, "status": response.status_code, "tokens": tokens}

        results = await open_loop(rate, seconds, seed, one)
        await asyncio.sleep(1.0)
        upstream = await upstream_stats(client, port)
    good = [r for r in results if r["status"] == 200 and r["latency_s"] <= DEADLINE_S]
    out: dict = {"requests": len(results), "goodput_tokens_per_s": sum(r["tokens"] for r in good) / seconds,
                 "goodput_rps": len(good) / seconds}
    for size in ("small", "large"):
        mine = [r for r in results if r["size"] == size]
        answered = [r["latency_s"] * 1000 for r in mine if r["status"] == 200]
        out[size] = {"requests": len(mine), "answered": len(answered),
                     "p50_ms": percentile(answered, 0.5), "p99_ms": percentile(answered, 0.99),
                     "goodput_rps": sum(r["size"] == size for r in good) / seconds,
                     "refused": sum(r["status"] in (429, 503) for r in mine),
                     "gave_up": sum(r["status"] == "gave_up" for r in mine)}
    out["wasted"] = upstream["disconnected"]
    out["upstream"] = upstream
    out["load_average_1m"] = os.getloadavg()[0]
    return out


def sidecar_metrics(stack: Stack) -> dict:
    """Cumulative admission refusals by reason, and each cluster's concurrency limit now."""
    import re
    text = httpx.get(f"http://127.0.0.1:{stack.ports.metrics}/metrics").text
    reasons: dict[str, float] = {}
    limits: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sluice_admission_requests_refused_total{"):
            reason = re.search(r'reason="([^"]*)"', line).group(1)
            reasons[reason] = reasons.get(reason, 0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("sluice_admission_concurrency_limit{"):
            limits[re.search(r'cluster="([^"]*)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return {"refusal_reasons": reasons, "concurrency_limits": limits}


async def run(stack: Stack, seconds: float) -> dict:
    results = {"unloaded": await phase(stack, "gate", CAPACITY_RPS * 0.2, min(seconds, 15), seed=1)}
    for arm in ARMS:
        results[arm] = await phase(stack, arm, CAPACITY_RPS * 3, seconds, seed=2)
    # The floor: the same VIP arrivals with no other traffic at all. Poisson arrivals bunch:
    # where more VIPs arrive within one service time than the cluster has slots, some wait
    # whatever the admission policy.
    results["vip_alone"] = await phase(stack, "gate", CAPACITY_RPS * 3, seconds, seed=2, vip_only=True)
    results["tenants"] = await phase(stack, "gate", CAPACITY_RPS * 3, seconds, seed=3, tenants=True)
    for arm in COST_ARMS:
        results[arm] = await cost_phase(stack, arm, COST_CAPACITY_RPS * 1.5, seconds, seed=4)
    return results


def goals(r: dict, vip_alone_ms: float, vip_unloaded_ms: float) -> dict:
    """The issue's goals for one arm, measured in this run."""
    vip_ratio = r["vip"]["p99_ms"] / vip_alone_ms
    left_after_vip = CAPACITY_RPS - r["vip"]["goodput_rps"]
    return {"vip_p99_vs_alone": vip_ratio, "vip_p99_vs_unloaded": r["vip"]["p99_ms"] / vip_unloaded_ms,
            "goodput_share": r["goodput_rps"] / CAPACITY_RPS,
            "standard_share_of_left": r["standard"]["goodput_rps"] / left_after_vip,
            "met": bool(vip_ratio <= 1.25 and r["goodput_rps"] >= 0.95 * CAPACITY_RPS and r["wasted"] == 0
                        and r["standard"]["goodput_rps"] >= 0.8 * left_after_vip)}


def fairness(r: dict) -> dict:
    """Others' share of goodput against their fair share: equal weights, and every light
    tenant asks for more than an equal share of capacity, so each tenant's fair share is 1/n."""
    per_tenant = r["tenant_goodput_rps"]
    total = sum(per_tenant.values())
    others = sum(v for t, v in per_tenant.items() if t != "heavy") / total if total else 0.0
    fair = LIGHT_TENANTS / (LIGHT_TENANTS + 1)
    return {"others_share": others, "fair_share": fair, "ratio": others / fair,
            "met": bool(abs(others / fair - 1) <= 0.10)}


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
        cost_upstream = ["--ttft-ms", str(COST_TTFT_MS), "--tokens", str(COST_TOKENS), "--tokens-per-s",
                         str(COST_TOKENS_PER_S), "--kv-tokens", str(KV_TOKENS)]
        with Stack(pathlib.Path(tmp), routes=routes(), extra_upstreams=tuple(u for u, _, _ in COST_ARMS.values()),
                   upstream_args={"a": upstream, "b": upstream + ["--scheduling-policy", "priority"],
                                  **{u: cost_upstream for u, _, _ in COST_ARMS.values()}},
                   envoy_vars={"RATE_LIMIT_TOKENS": 100_000},
                   sidecar_env={"SLUICE_CACHE": "false",
                                "SLUICE_ADMISSION_RESERVED_SLOTS": str(args.reserved_slots)}) as stack:
            results = asyncio.run(run(stack, args.seconds))
    rows = []
    for arm in ARMS:
        r = results[arm]
        for cls in ("vip", "standard"):
            c = r[cls]
            rows.append({"arm": ARM_TITLES[arm], "class": cls, "requests": c["requests"], "answered": c["answered"],
                         "p50 ms": c["p50_ms"], "p99 ms": c["p99_ms"], "goodput/s": c["goodput_rps"],
                         "refused": c["refused"], "gave up": c["gave_up"]})
    print(f"capacity {CAPACITY_RPS:.1f} req/s ({SLOTS} slots x {SERVICE_S:.2f} s), arrivals 3x for "
          f"{args.seconds:g} s, {VIP_SHARE:.0%} VIP, client deadline {DEADLINE_S:g} s")
    print(report.table(rows, ["arm", "class", "requests", "answered", "p50 ms", "p99 ms", "goodput/s", "refused",
                              "gave up"]))
    vip_unloaded = results["unloaded"]["vip"]["p99_ms"]
    alone = results["vip_alone"]["vip"]["p99_ms"]
    print(f"VIP p99 unloaded {vip_unloaded:.0f} ms; the same VIP arrivals alone {alone:.0f} ms "
          f"({alone / vip_unloaded:.2f}x unloaded), the floor without preemption")
    checked = {arm: goals(results[arm], alone, vip_unloaded) for arm in ARMS}
    goal_rows = [{"arm": ARM_TITLES[arm], "VIP p99 / alone": g["vip_p99_vs_alone"],
                  "VIP p99 / unloaded": g["vip_p99_vs_unloaded"], "goodput / capacity": g["goodput_share"],
                  "wasted": results[arm]["wasted"], "preempted": results[arm]["preempted"],
                  "std / left after VIP": g["standard_share_of_left"], "goals met": g["met"]}
                 for arm, g in checked.items()]
    print("goals: VIP p99 / alone <= 1.25, goodput >= 95% of capacity, wasted 0, standard >= 80% of what VIP leaves")
    print(report.table(goal_rows, list(goal_rows[0])))
    fair = fairness(results["tenants"])
    print(f"tenants (gate, 1 tenant at {HEAVY_FACTOR}x each of {LIGHT_TENANTS} others, 3x capacity): others' goodput "
          f"share {fair['others_share']:.1%} against a fair {fair['fair_share']:.1%} (ratio {fair['ratio']:.2f}, "
          f"goal within 10%: {fair['met']})")
    engine_wasted = results["engine_priority"]
    print(f"wasted in the engine priority arm: {engine_wasted['wasted']} (time held upstream, preemptions: "
          + ", ".join(f"{w['after_s']:.2f} s, {w['preemptions']}" for w in engine_wasted["wasted_detail"]) + ")")
    cost_rows = [{"count_tokens": arm.rsplit("_", 1)[1], "goodput tok/s": r["goodput_tokens_per_s"],
                  "goodput/s": r["goodput_rps"], "small p50 ms": r["small"]["p50_ms"],
                  "small p99 ms": r["small"]["p99_ms"], "small goodput/s": r["small"]["goodput_rps"],
                  "large answered": f"{r['large']['answered']}/{r['large']['requests']}",
                  "refused": r["small"]["refused"] + r["large"]["refused"],
                  "gave up": r["small"]["gave_up"] + r["large"]["gave_up"], "wasted": r["wasted"]}
                 for arm, r in ((arm, results[arm]) for arm in COST_ARMS)]
    print(f"cost-aware admission: engine room {KV_TOKENS} tokens, {LARGE_SHARE:.0%} of requests "
          f"~{LARGE_PROMPT_TOKENS + COST_TOKENS} tokens, the rest ~{SMALL_TOKENS}, at 1.5x capacity "
          f"({COST_CAPACITY_RPS:.1f} req/s), gate limit {COST_MAX_IN_FLIGHT} (no goal set: figures)")
    print(report.table(cost_rows, list(cost_rows[0])))
    print(f"gate refusals by reason (cumulative): {results['gate']['refusal_reasons']}")
    print(f"concurrency limits after the engine priority arm: {results['engine_priority']['concurrency_limits']}")
    print("1-minute load average at the end of each phase: "
          + ", ".join(f"{name} {r['load_average_1m']:.1f}" for name, r in results.items()))
    keys = ("p50_ms", "p99_ms", "goodput_rps")
    out = {"capacity_rps": CAPACITY_RPS, "reserved_slots": args.reserved_slots,
           "unloaded": {"vip_p99_ms": vip_unloaded}, "vip_alone": {"vip_p99_ms": alone},
           "tenant_fairness": fair,
           "cost_aware": {"kv_tokens": KV_TOKENS, "large_share": LARGE_SHARE, "capacity_rps": COST_CAPACITY_RPS,
                          "max_in_flight": COST_MAX_IN_FLIGHT,
                          **{arm: {k: results[arm][k] for k in ("goodput_tokens_per_s", "goodput_rps", "small",
                                                                   "large", "wasted")} for arm in COST_ARMS}}}
    for arm in ARMS:
        r = results[arm]
        out[arm] = {"vip": {k: r["vip"][k] for k in keys}, "standard": {k: r["standard"][k] for k in keys},
                    "goodput_rps": r["goodput_rps"], "refused": r["refused"], "wasted": r["wasted"],
                    "preempted": r["preempted"], "wasted_detail": r["wasted_detail"], "goals": checked[arm],
                    # Both ratios of the VIP goal: to the same VIP arrivals alone, and to unloaded.
                    "vip_p99_vs_alone": checked[arm]["vip_p99_vs_alone"],
                    "vip_p99_vs_unloaded": checked[arm]["vip_p99_vs_unloaded"]}
    out["details"] = results
    print(f"wrote {report.write('overload', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
