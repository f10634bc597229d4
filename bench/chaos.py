"""`make chaos`: faults under load through the real Envoy, sidecar(s), Redis and demo upstreams.

Each scenario starts its own stack, runs ~20 closed-loop clients for `--duration` seconds,
injects its fault part-way (and heals it), and judges what the clients saw against the goal of
issue 18's table. Prints a table (scenario, requests, client-visible failures, p99, time to
recover, goal met) and writes reports/chaos.json with each scenario's figures.

    python -m bench.chaos [--duration 30] [--clients 20] [--only NAME ...] [--scopes 50000]

A shorter --duration gives quick runs (the fault times scale with it, with floors).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import signal
import socket
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Awaitable, Callable

import httpx

from bench import report
from bench.openloop import percentile
from devtools.envoy_config import chat_route
from devtools.stack import Stack

WORKDIR = pathlib.Path(__file__).resolve().parent.parent / "build" / "chaos"
UPSTREAM = ["--ttft-ms", "20", "--tokens", "8", "--tokens-per-s", "400"]
# As the reference template's route: one retry on the other cluster before the first byte, and
# a first-byte budget (TTFT_BUDGET_S) after which an attempt is cut and retried.
TTFT_BUDGET_S = 1.0
ROUTES = [chat_route("chat", "/", [{"cluster": "upstream_a"}, {"cluster": "upstream_b"}],
                     scheduling={"retry_other_cluster": True,
                                 "timeout": {"first_byte_ms": round(TTFT_BUDGET_S * 1000)}})]
PROMPTS = 200            # distinct prompts the clients draw from (repeats give cache hits)


# --- the load --------------------------------------------------------------------------------

@dataclass
class Result:
    t: float                      # start, seconds from the scenario's start
    latency: float
    status: int | None            # None: no HTTP answer (connection error, client timeout)
    ok: bool                      # a 200 with a whole, valid chat completion
    shaped: bool                  # an error answer in OpenAI's shape (error.type/message/code)
    upstream: str | None          # x-upstream-name: which demo upstream answered
    steered: bool                 # x-sluice-cluster: the sidecar chose the cluster
    cache: str | None
    retry_after: str | None
    retried: bool = False         # x-envoy-attempt-count 2: Envoy's retry (the other cluster) answered


def _judge(status: int, headers: httpx.Headers, body: bytes) -> tuple[bool, bool]:
    try:
        data = json.loads(body)
    except ValueError:
        return False, False
    if not isinstance(data, dict):
        return False, False
    ok = status == 200 and isinstance(data.get("choices"), list) and bool(data["choices"])
    error = data.get("error")
    shaped = isinstance(error, dict) and all(isinstance(error.get(k), str) for k in ("type", "message", "code"))
    return ok, shaped


class Load:
    """`clients` closed-loop clients posting chat requests until stopped."""

    def __init__(self, base: str, clients: int, body: Callable[[random.Random], dict], timeout: float = 30.0):
        self.base, self.clients, self.body, self.timeout = base, clients, body, timeout
        self.results: list[Result] = []
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._stop = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.started

    async def run(self, seconds: float) -> list[Result]:
        limits = httpx.Limits(max_connections=self.clients, max_keepalive_connections=self.clients)
        async with httpx.AsyncClient(base_url=self.base, limits=limits, timeout=self.timeout) as http:
            tasks = [asyncio.create_task(self._client(http, i)) for i in range(self.clients)]
            await asyncio.sleep(seconds)
            self._stop.set()
            await asyncio.gather(*tasks)
        return self.results

    async def _client(self, http: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(index)
        while not self._stop.is_set():
            t = self.now()
            status = headers = None
            body = b""
            try:
                response = await http.post("/v1/chat/completions", json=self.body(rng),
                                           headers={"authorization": "Bearer chaos"})
                status, headers, body = response.status_code, response.headers, response.content
            except httpx.HTTPError:
                pass
            latency = self.now() - t
            ok, shaped = _judge(status, headers, body) if status is not None else (False, False)
            h = headers or {}
            self.results.append(Result(t, latency, status, ok, shaped, h.get("x-upstream-name"),
                                       "x-sluice-cluster" in h, h.get("x-sluice-cache"), h.get("retry-after"),
                                       h.get("x-envoy-attempt-count") == "2"))
            if status is None or status >= 500:
                await asyncio.sleep(0.05)       # a client backs off a little after a failure


def chat_body(rng: random.Random, prompts: int = PROMPTS) -> dict:
    return {"model": "demo-model", "max_tokens": 8,
            "messages": [{"role": "user", "content": f"chaos question {rng.randrange(prompts)}"}]}


def repeated_body(rng: random.Random) -> dict:
    """Few prompts: most requests are exact cache hits once warm."""
    return chat_body(rng, prompts=40)


# --- scenario plumbing -----------------------------------------------------------------------

@dataclass
class Run:
    stack: Stack
    load: Load
    duration: float
    marks: dict = field(default_factory=dict)     # name -> seconds from the start
    extra: dict = field(default_factory=dict)     # scenario figures

    def mark(self, name: str) -> float:
        self.marks[name] = round(self.load.now(), 3)
        return self.marks[name]

    async def at(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds - self.load.now()))

    def configure(self, upstream: str, **options) -> None:
        port = self.stack.upstream_port(upstream)
        httpx.post(f"http://127.0.0.1:{port}/admin/config", json=options).raise_for_status()


@dataclass
class Logged:
    """A request as Envoy's access log saw it: its own clock, not the load generator's."""
    t: float                  # start, seconds from the scenario's start
    status: int
    duration_ms: float        # downstream start to end, in Envoy
    added_ms: float           # duration less the upstream's service time: what Envoy + sidecar added


def envoy_log(run: Run) -> list[Logged]:
    """The access-log lines of the run (Envoy flushes them at the latest when it stops)."""
    found = []
    for line in (run.stack.workdir / "envoy.log").read_text(errors="replace").splitlines():
        if not line.startswith('{"'):
            continue
        try:
            entry = json.loads(line)
            start = datetime.fromisoformat(entry["time"].replace("Z", "+00:00")).timestamp()
            duration = float(entry["duration_ms"])
            upstream = float(entry["upstream_ms"]) if entry.get("upstream_ms") not in (None, "", "-") else 0.0
            found.append(Logged(start - run.load.started_wall, int(entry["status"]), duration, duration - upstream))
        except (ValueError, KeyError, TypeError):
            continue
    return found


@dataclass
class Scenario:
    name: str
    goal: str
    inject: Callable[[Run], Awaitable[None]]
    judge: Callable[[Run, list[Result]], dict]       # recover_s, met, and figures
    stack: dict = field(default_factory=dict)        # Stack(...) arguments
    clients: int | None = None
    body: Callable[[random.Random], dict] = chat_body
    redis: bool = False


def summary(results: list[Result]) -> dict:
    latencies = [r.latency for r in results]
    return {"requests": len(results), "failures": sum(not r.ok for r in results),
            "p50_ms": percentile(latencies, 0.5) * 1000, "p99_ms": percentile(latencies, 0.99) * 1000}


def first_after(results: list[Result], t: float, test: Callable[[Result], bool]) -> float | None:
    """Seconds from t until the first request started after t that passes `test` ended."""
    ends = [r.t + r.latency for r in results if r.t >= t and test(r)]
    return round(min(ends) - t, 3) if ends else None


def between(results: list[Result], start: float, end: float) -> list[Result]:
    return [r for r in results if start <= r.t < end]


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"   # what Envoy health-checks


def sidecar_serving(run: Run, name: str, timeout: float = 30.0) -> bool:
    """Wait until the sidecar's own gRPC health service answers SERVING (it loads its models
    first; its metrics port answers sooner)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    port = run.stack.sidecar_ports(name)[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # A fresh channel each try: one made before the server listens waits out gRPC's
        # reconnect backoff (a second or more) and would mark SERVING late.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE), timeout=0.5)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
        time.sleep(0.01)
    return False


def sidecar_restart(run: Run, name: str = "sidecar") -> Callable[[], Awaitable[None]]:
    async def restart() -> None:
        await asyncio.to_thread(run.stack.start_sidecar, name)
        run.mark("restarted")
        if await asyncio.to_thread(sidecar_serving, run, name):
            run.mark("serving")
    return restart


# --- the sidecar --------------------------------------------------------------------------------

async def kill_sidecar(run: Run) -> None:
    await run.at(run.duration * 0.25)
    run.mark("fault")
    await asyncio.to_thread(run.stack.stop_process, "sidecar", signal.SIGKILL)
    await run.at(run.duration * 0.5)
    await sidecar_restart(run)()


def steering_back(run: Run, results: list[Result]) -> float | None:
    """Seconds from the restart (metrics port up) to the first steered answer; also recorded
    from the sidecar's gRPC health SERVING, which is Envoy's cue (the rest is the sidecar's boot)."""
    steered = lambda r: r.ok and r.steered        # noqa: E731
    if "serving" in run.marks:
        run.extra["steering_back_after_serving_s"] = first_after(results, run.marks["serving"], steered)
    return first_after(results, run.marks["restarted"], steered)


def judge_kill_open(run: Run, results: list[Result]) -> dict:
    recover = steering_back(run, results)
    failures = sum(not r.ok for r in results)
    return {"recover_s": recover, "met": failures == 0 and recover is not None and recover <= 1.0}


def judge_kill_closed(run: Run, results: list[Result]) -> dict:
    refusals = [r for r in results if not r.ok]
    unshaped = [r for r in refusals if not (r.status == 503 and r.shaped and r.retry_after)]
    # Refusal time as Envoy measured it (the load generator's own clock includes its waits for CPU).
    # Those already inside the sidecar when it died waited for it before; judged: the ones after.
    fault = run.marks["fault"]
    logged = [e.duration_ms for e in envoy_log(run) if e.status == 503 and e.t >= fault]
    run.extra["refusals_in_flight_at_kill"] = sum(1 for e in envoy_log(run) if e.status == 503 and e.t < fault)
    slow = [d for d in logged if d > 50]
    recover = steering_back(run, results)
    run.extra.update(refusals=len(refusals), refusals_not_shaped=len(unshaped),
                     refusal_envoy_max_ms=max(logged, default=None), refusals_envoy_over_50ms=len(slow),
                     refusal_client_p99_ms=round(percentile([r.latency for r in refusals], 0.99) * 1000, 1)
                     if refusals else None)
    return {"recover_s": recover,
            "met": bool(logged) and not slow and not unshaped and recover is not None and recover <= 1.0}


async def freeze_sidecar(run: Run) -> None:
    await run.at(run.duration * 0.25)
    proc = run.stack.procs["sidecar"]
    run.mark("fault")
    proc.send_signal(signal.SIGSTOP)
    await asyncio.sleep(10)
    proc.send_signal(signal.SIGCONT)
    run.mark("healed")


def judge_freeze(fail_open: bool) -> Callable[[Run, list[Result]], dict]:
    def judge(run: Run, results: list[Result]) -> dict:
        fault, healed = run.marks["fault"], run.marks["healed"]
        logged = envoy_log(run)
        frozen = [e for e in logged if fault <= e.t < healed]
        # Cut off: from 3 s into the freeze (the goal's "<= 3 s of added latency") to the thaw.
        cut = [e for e in frozen if e.t >= fault + 3.0]
        before = between(results, 1.0, fault)
        rate_before = len(before) / max(fault - 1.0, 1e-9)
        rate_cut = len(between(results, fault + 3.0, healed)) / max(healed - fault - 3.0, 1e-9)
        recover = first_after(results, healed, lambda r: r.ok and r.steered)
        added_max = max((e.added_ms for e in frozen), default=0.0)
        added_cut_p99 = percentile([e.added_ms for e in cut], 0.99)
        # What Envoy and the working sidecar added before the freeze: "full speed" is no more.
        added_before_p99 = percentile([e.added_ms for e in logged if 1.0 <= e.t < fault], 0.99)
        run.extra.update(added_latency_max_ms=added_max, added_latency_p99_cut_off_ms=added_cut_p99,
                         added_latency_p99_before_ms=added_before_p99,
                         req_per_s_before=round(rate_before, 1), req_per_s_while_cut_off=round(rate_cut, 1))
        if fail_open:
            met = (sum(not r.ok for r in results) == 0 and added_max <= 3000 and bool(cut)
                   and added_cut_p99 <= max(added_before_p99, 10))
        else:
            refusals = [e for e in cut if e.status != 200]
            unshaped = [r for r in between(results, fault + 3.0, healed) if not r.ok and not (r.status == 503 and r.shaped)]
            slow = [e for e in refusals if e.duration_ms > 50]
            run.extra.update(refusals_after_cutoff=len(refusals), refusals_envoy_over_50ms=len(slow),
                             refusals_not_shaped=len(unshaped))
            met = bool(refusals) and not slow and not unshaped
        return {"recover_s": recover, "met": met}
    return judge


async def kill_one_replica(run: Run) -> None:
    await run.at(run.duration * 0.25)
    run.mark("fault")
    await asyncio.to_thread(run.stack.stop_process, "sidecar2", signal.SIGKILL)


def judge_replica(fail_open: bool) -> Callable[[Run, list[Result]], dict]:
    def judge(run: Run, results: list[Result]) -> dict:
        fault = run.marks["fault"]
        failed = [r for r in results if not r.ok and r.t >= fault - 1]
        # Failover: from the kill to the end of the last failed request.
        failover = round(max(r.t + r.latency for r in failed) - fault, 3) if failed else 0.0
        if fail_open:
            return {"recover_s": failover, "met": not failed}
        return {"recover_s": failover, "met": failover <= 1.0}
    return judge


# --- Redis -----------------------------------------------------------------------------------

async def redis_fault(run: Run) -> None:
    redis = run.extra.pop("_redis")
    quarter = run.duration * 0.25
    await run.at(quarter)
    run.mark("kill")
    await asyncio.to_thread(redis.stop)
    await run.at(quarter * 2)
    await asyncio.to_thread(redis.start)
    run.mark("restarted")
    back = await asyncio.to_thread(_wait_for_keys, redis.port, 10.0)
    run.extra["shared_tier_back_s"] = None if back is None else round(back, 3)
    await run.at(quarter * 3)
    run.mark("stop")
    redis.proc.send_signal(signal.SIGSTOP)
    await asyncio.sleep(min(5.0, quarter * 0.8))
    redis.proc.send_signal(signal.SIGCONT)
    run.mark("cont")


def _wait_for_keys(port: int, timeout: float) -> float | None:
    """Seconds until the restarted (empty) Redis holds a key again: the shared tier is written to."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"DBSIZE\r\n")
                if int(s.recv(64).strip()[1:] or 0) > 0:
                    return time.monotonic() - started
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


def judge_redis(run: Run, results: list[Result]) -> dict:
    m = run.marks
    hits = lambda rs: sum(r.cache == "exact" for r in rs) / max(len(rs), 1)  # noqa: E731
    run.extra.update(exact_hits_before=round(hits(between(results, 2.0, m["kill"])), 3),
                     exact_hits_redis_killed=round(hits(between(results, m["kill"] + 0.5, m["restarted"])), 3),
                     exact_hits_redis_stopped=round(hits(between(results, m["stop"] + 0.5, m["cont"])), 3))
    back = run.extra.get("shared_tier_back_s")
    failures = sum(not r.ok for r in results)
    met = (failures == 0 and run.extra["exact_hits_redis_killed"] > 0 and back is not None and back <= 2.0)
    return {"recover_s": back, "met": met}


# --- upstream clusters -------------------------------------------------------------------------

def cluster_fault(mode: str, heal_after: float | None = None) -> Callable[[Run], Awaitable[None]]:
    async def inject(run: Run) -> None:
        await run.at(run.duration * 0.25)
        run.mark("fault")
        run.configure("b", error_rate=1.0, error_mode=mode)
        if heal_after is not None:
            await asyncio.sleep(heal_after)
            run.configure("b", error_rate=0.0)
            run.mark("healed")
    return inject


def judge_500s(run: Run, results: list[Result]) -> dict:
    after = between(results, run.marks["fault"], run.marks["fault"] + 30)
    failed = [r for r in after if not r.ok]
    share = len(failed) / max(len(after), 1)
    # Sent to b: answered by b (a 500), or by Envoy's retry on a.
    last = max((r.t for r in after if r.upstream == "b" or r.retried), default=run.marks["fault"])
    run.extra.update(failed_share_after_fault=round(share, 4), retried=sum(r.retried for r in after))
    return {"recover_s": round(last - run.marks["fault"], 3), "met": share <= 0.01}


def judge_midstream(run: Run, results: list[Result]) -> dict:
    fault = run.marks["fault"]
    after = between(results, fault, fault + 30)
    broken = [r for r in after if not r.ok]
    # The breaker is open once b stops getting requests (but for probes): the last of the first
    # run of requests to b after the fault.
    to_b = sorted(r.t for r in after if r.upstream == "b" or (not r.ok and r.status != 200))
    opened = next((to_b[i] for i in range(len(to_b) - 1) if to_b[i + 1] - to_b[i] > 1.0), to_b[-1] if to_b else fault)
    share = len(broken) / max(len(after), 1)
    run.extra.update(broken_share=round(share, 4), breaker_open_after_s=round(opened - fault, 3))
    return {"recover_s": round(opened - fault, 3), "met": opened - fault <= 5.0 and share <= 0.05}


def judge_hang(run: Run, results: list[Result]) -> dict:
    fault, healed = run.marks["fault"], run.marks["healed"]
    during = between(results, fault, healed)
    # The wait as Envoy measured it (the load generator's clock includes its own waits for CPU;
    # both are reported).
    longest = max((e.duration_ms for e in envoy_log(run) if fault <= e.t < healed), default=0.0) / 1000
    # A request that went to b first either failed or was answered by Envoy's retry on a.
    hung = [r for r in during if r.retried or not r.ok]
    avoided = max((r.t for r in hung), default=fault) - fault
    back = first_after(results, healed, lambda r: r.upstream == "b" and r.ok)
    run.extra.update(longest_wait_envoy_s=round(longest, 3),
                     longest_wait_client_s=round(max((r.latency for r in during), default=0.0), 3),
                     avoided_after_s=round(avoided, 3), back_after_heal_s=back,
                     retried=sum(r.retried for r in during), failed=sum(not r.ok for r in during))
    met = longest <= TTFT_BUDGET_S + 1.0 and avoided <= 3.0 and back is not None and back <= 10.0
    return {"recover_s": back, "met": met}


# --- slow clients ------------------------------------------------------------------------------

SLOWLORIS_BODY_TIMEOUT_S = 10.0


async def slowloris(run: Run) -> None:
    await run.at(run.duration * 0.25)
    run.mark("fault")
    port = run.stack.ports.http
    freed: list[float] = []

    async def one() -> None:
        started = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n")
        try:
            while time.monotonic() - started < SLOWLORIS_BODY_TIMEOUT_S * 3:
                writer.write(b" ")
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), timeout=1.0) == b"":
                        break
                    break                           # Envoy answered (408) and will close
                except asyncio.TimeoutError:
                    continue
        except OSError:
            pass
        finally:
            freed.append(time.monotonic() - started)
            writer.close()
    await asyncio.gather(*(one() for _ in range(50)))
    run.extra.update(slowloris_freed_max_s=round(max(freed), 3) if freed else None,
                     slowloris_connections=len(freed))


def judge_slowloris(run: Run, results: list[Result]) -> dict:
    fault = run.marks["fault"]
    before = between(results, 1.0, fault)
    during = between(results, fault, fault + SLOWLORIS_BODY_TIMEOUT_S)
    p99_before = percentile([r.latency for r in before], 0.99) * 1000
    p99_during = percentile([r.latency for r in during], 0.99) * 1000
    freed = run.extra.get("slowloris_freed_max_s")
    run.extra.update(others_p99_before_ms=round(p99_before, 1), others_p99_during_ms=round(p99_during, 1))
    met = (freed is not None and freed <= SLOWLORIS_BODY_TIMEOUT_S + 1.5
           and p99_during <= max(1.5 * p99_before, p99_before + 50) and not any(not r.ok for r in results))
    return {"recover_s": freed, "met": met}


# --- memory under a flood of cache scopes ----------------------------------------------------------

def scope_body(rng: random.Random) -> dict:
    """A new cache scope per request: a seed nobody else sends."""
    return {**chat_body(rng), "seed": rng.getrandbits(48)}


async def scope_flood(run: Run) -> None:
    pid = run.stack.procs["sidecar"].pid
    run.extra["rss_before_mb"] = round(report.rss_mb(pid), 1)
    target = run.extra.pop("_scopes")
    while len(run.load.results) < target and not run.load._stop.is_set():
        await asyncio.sleep(0.5)
        run.extra["rss_peak_mb"] = max(run.extra.get("rss_peak_mb", 0.0), round(report.rss_mb(pid), 1))
    run.extra["scopes_sent"] = len(run.load.results)
    run.load._stop.set()


def judge_scopes(run: Run, results: list[Result]) -> dict:
    budget = run.extra["cache_budget_mb"]
    growth = run.extra.get("rss_peak_mb", 0.0) - run.extra["rss_before_mb"]
    run.extra["rss_growth_mb"] = round(growth, 1)
    complete = run.extra.get("scopes_sent", 0) >= run.extra["scopes_wanted"]
    return {"recover_s": None, "met": complete and growth <= budget and not any(not r.ok for r in results)}


# --- the table -----------------------------------------------------------------------------------

OPEN, CLOSED = {"FAILURE_MODE_ALLOW": "true"}, {"FAILURE_MODE_ALLOW": "false"}
CACHE_OFF = {"SLUICE_CACHE": "false"}

SCENARIOS = [
    Scenario("sidecar SIGKILL, fail-open", "0 failed; steering back <= 1 s after restart",
             kill_sidecar, judge_kill_open, {"envoy_vars": OPEN}),
    Scenario("sidecar SIGKILL, fail-closed", "refusals OpenAI-shaped 503s within 50 ms; steering <= 1 s after restart",
             kill_sidecar, judge_kill_closed, {"envoy_vars": CLOSED}),
    Scenario("sidecar SIGSTOP 10 s, fail-open", "0 failed; <= 3 s added latency; then full throughput",
             freeze_sidecar, judge_freeze(True), {"envoy_vars": OPEN}),
    Scenario("sidecar SIGSTOP 10 s, fail-closed", "fast OpenAI-shaped 503s once cut off",
             freeze_sidecar, judge_freeze(False), {"envoy_vars": CLOSED}),
    Scenario("1 of 2 replicas killed, fail-open", "0 failed",
             kill_one_replica, judge_replica(True), {"envoy_vars": OPEN, "sidecars": 2}),
    Scenario("1 of 2 replicas killed, fail-closed", "failover within 1 s",
             kill_one_replica, judge_replica(False), {"envoy_vars": CLOSED, "sidecars": 2}),
    Scenario("Redis SIGKILL then SIGSTOP", "0 failed; exact hits go on; shared tier back <= 2 s",
             redis_fault, judge_redis, body=repeated_body, redis=True),
    Scenario("cluster b answers 500s", "<= 1% failed over the 30 s after the fault",
             cluster_fault("500"), judge_500s),
    Scenario("cluster b resets mid-answer", "breaker open <= 5 s; <= 5% broken over 30 s",
             cluster_fault("midstream"), judge_midstream),
    Scenario("cluster b hangs (10 s)", "wait <= TTFT budget + 1 s; avoided <= 3 s; back <= 10 s after healing",
             cluster_fault("hang", heal_after=10.0), judge_hang),
    Scenario("50 slowloris connections", "freed within the body timeout; others' p99 unchanged",
             slowloris, judge_slowloris, {"envoy_vars": {"REQUEST_TIMEOUT": f"{SLOWLORIS_BODY_TIMEOUT_S:g}s"}}),
    Scenario("distinct cache scopes flood", "sidecar RSS growth within the cache budget",
             scope_flood, judge_scopes, body=scope_body),
]


async def run_scenario(scenario: Scenario, duration: float, clients: int, workdir: pathlib.Path,
                       scopes: int, cache_budget_mb: float) -> dict:
    kwargs = {"routes": ROUTES, "upstream_args": {"a": UPSTREAM, "b": UPSTREAM}, **scenario.stack}
    env = dict(kwargs.pop("sidecar_env", {}))
    redis = None
    extra: dict = {}
    if scenario.redis:
        from tests.support.redis_server import RedisServer
        redis = RedisServer(workdir / "redis").start()
        env.update(SLUICE_REDIS_URL=redis.url, SLUICE_CACHE_SECRET="chaos-suite-secret-0123456789")
        extra["_redis"] = redis
    elif scenario.judge is judge_scopes:
        env.update(SLUICE_CACHE_MAX_MIB=f"{cache_budget_mb:g}")
        extra.update(_scopes=scopes, scopes_wanted=scopes, cache_budget_mb=cache_budget_mb)
        duration = max(duration, scopes / 50)       # until every scope is sent (or this long)
    else:
        env.setdefault("SLUICE_CACHE", "false")      # routing faults: every request goes upstream
    stack = Stack(workdir / "stack", sidecar_env=env, **kwargs)
    await asyncio.to_thread(stack.start)
    try:
        load = Load(stack.base_url[: -len("/v1")], scenario.clients or clients, scenario.body)
        run = Run(stack, load, duration, extra=extra)
        injector = asyncio.create_task(scenario.inject(run))
        results = await load.run(duration)
        await injector
    finally:
        await asyncio.to_thread(stack.stop)      # Envoy flushes its access log
        if redis is not None:
            redis.stop()
    verdict = scenario.judge(run, results)
    figures = {k: v for k, v in run.extra.items() if not k.startswith("_")}
    return {"scenario": scenario.name, "goal": scenario.goal, **summary(results),
            "recover_s": verdict["recover_s"], "goal_met": verdict["met"], "marks": run.marks, **figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per scenario (>= 16)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=None, help="scenarios whose name contains one of these")
    parser.add_argument("--scopes", type=int, default=50_000, help="distinct cache scopes in the flood")
    parser.add_argument("--cache-budget-mb", type=float, default=256.0,
                        help="the cache's byte budget (SLUICE_CACHE_MAX_MIB) the flood must stay within")
    args = parser.parse_args()
    duration = max(16.0, args.duration)
    chosen = [s for s in SCENARIOS if not args.only or any(o.lower() in s.name.lower() for o in args.only)]
    rows = []
    shutil.rmtree(WORKDIR, ignore_errors=True)      # the last run's logs, kept until the next
    for i, scenario in enumerate(chosen):
        print(f"[{i + 1}/{len(chosen)}] {scenario.name} ...", flush=True)
        row = asyncio.run(run_scenario(scenario, duration, args.clients, WORKDIR / str(i),
                                       args.scopes, args.cache_budget_mb))
        print("   ", json.dumps({k: v for k, v in row.items() if k not in ("scenario", "goal")}), flush=True)
        rows.append(row)
    print()
    print(report.table(rows, ["scenario", "requests", "failures", "p99_ms", "recover_s", "goal_met"]))
    path = report.write("chaos", {"duration_s": duration, "clients": args.clients, "scenarios": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
