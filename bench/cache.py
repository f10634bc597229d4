"""`make bench-cache` (= `python -m bench.cache`): what the answer cache buys and what it costs.

One run, about 4.5 minutes on the 2-core box; real Envoy + the Sluice sidecar + demo upstreams
(devtools.stack), and beside it the same with a no-op sidecar:

1. Quality on a replayed stream. PAIRS labelled pairs from ../shared/data/paraphrase/dev.jsonl
   (beside the repo, or $SLUICE_PARAPHRASE), a third from each source. Every pair is asked
   at least twice: its `a` first, its `b` (a paraphrase or not, per the label) later; on top
   of that EXTRA requests are drawn over the pairs with Zipf(s) popularity (a or b alike), so
   popular prompts repeat. Requests are shuffled in time within those rules and sent one at
   a time through Envoy (so `a`'s answer is stored before `b` arrives). The demo upstream's
   answer is a deterministic function of the prompt; the answer each prompt should get is
   asked of a second demo upstream directly (same engine, no Envoy). A hit whose content is
   not this prompt's answer was served from another prompt: correct when the two are a
   label-1 pair, a false hit when they are a label-0 pair or no labelled pair at all.
   Reports hit rates per tier, false hits (per semantic hit and per 1000 requests) and
   upstream calls saved (from the upstream's /admin/stats), overall and per source.
2. Latency at concurrency 1 (upstream time to first token 50 ms, so misses stand apart):
   the replay's own per-tier p50/p99 (httpx client) and wrk on one cached body (exact) and
   on the paraphrases that hit semantically (wrk with a Lua script rotating bodies).
3. Throughput with wrk at concurrency 16 and 64: exact hits on one cached body against
   Envoy + a no-op sidecar passing the same body to a fast upstream (ttft 0, one token),
   for two bodies: bench.overhead's ~2 KB one and a short question (the per-request cost of
   an exact hit grows with the prompt's length). The two stacks run side by side and take
   turns (`--turns` each per point, the median kept; the ratio is the median of the turns'
   ratios), so a minute's drift on a shared machine does not land in the comparison. Semantic hits (rotating the paraphrase
   bodies; each request embeds its text once) against the embedder's own texts/s on the
   same texts at the same concurrency (EmbeddingService in this process, as many closed-loop
   callers as wrk had connections, with the stack idle). The embedder's rate depends on
   its callers (deeper queues make bigger groups), so each point is compared with its own.
   The embedder runs on the sidecar's event loop (uvloop unless SLUICE_EVENT_LOOP says
   otherwise). Where a semantic hit's CPU time goes (the sidecar's event loop, its other
   threads, Envoy) is printed beside the embedder's own CPU time per text: on a box whose
   cores the model fills, their ratio bounds the hits' rate. So is an exact hit's CPU time
   (short body): a semantic hit costs at least that plus the embedding, which gives the
   ceiling the semantic ratio could reach here with no cost of its own.
4. TTFT of streamed cache misses: on a cacheable miss the sidecar asks Envoy for the
   response body (STREAMED for SSE), so it sits on the token path. Fresh prompts, upstream
   ttft 100 ms and 30 tokens, alternating between the cached route and a route with
   `cache: {enabled: false}` in the same run: time to the first content chunk and to the end.
5. The sidecar's RSS at start (model loaded, cache empty) and after the run.

Prints a table per part and writes reports/cache.json.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import pathlib
import random
import statistics
import tempfile
import time

import httpx

from bench import overhead, report, sidecar_loop, turns, wrk
from devtools.envoy_config import chat_route
from devtools.stack import Stack
from sidecar.cache.policy import time_sensitive_word

PAIRS = 400
EXTRA = 800                  # Zipf-drawn repeats on top of each pair's a and b
ZIPF_S = 1.1
SEED = 11
SOURCES = ("qqp", "mrpc-train", "stsb-train")
TTFT_PROMPTS = 40
HEADERS = {"authorization": "Bearer bench", "content-type": "application/json"}
MODEL = "demo-model"

# Upstream a serves the routes; b is the reference copy asked directly for the right answers.
REPLAY_UPSTREAM = ["--ttft-ms", "50", "--tokens", "16", "--tokens-per-s", "2000"]
REFERENCE_UPSTREAM = ["--ttft-ms", "0", "--tokens", "16", "--tokens-per-s", "1000000"]
STREAM_CONFIG = {"ttft_ms": 100.0, "tokens": 30, "tokens_per_s": 200.0}
TIERS = ("exact", "semantic", "coalesced", "miss", "bypass")
CONCURRENCY = (1, 16, 64)
# Exact-hit bodies: bench.overhead's ~2 KB chat body (its no-op figures compare), and a
# short question like the replayed ones.
SHORT_PROMPT = "How do I reset my password when the reset link has expired?"

# wrk rotating over bodies (one JSON body a line) and counting x-sluice-cache per response.
ROTATE_LUA = """
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = "Bearer bench"
bodies = {}
for line in io.lines("%(bodies)s") do bodies[#bodies + 1] = line end
counter = 0
n_exact, n_semantic, n_coalesced, n_miss, n_bypass, n_other = 0, 0, 0, 0, 0, 0
local threads = {}
setup = function(thread) table.insert(threads, thread) end
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, nil, bodies[(counter %% #bodies) + 1])
end
response = function(status, headers, body)
  local tier = headers["x-sluice-cache"]
  if status ~= 200 then n_other = n_other + 1
  elseif tier == "exact" then n_exact = n_exact + 1
  elseif tier == "semantic" then n_semantic = n_semantic + 1
  elseif tier == "coalesced" then n_coalesced = n_coalesced + 1
  elseif tier == "miss" then n_miss = n_miss + 1
  elseif tier == "bypass" then n_bypass = n_bypass + 1
  else n_other = n_other + 1 end
end
done = function(summary, latency, requests)
  local t = {exact = 0, semantic = 0, coalesced = 0, miss = 0, bypass = 0, other = 0}
  for _, thread in ipairs(threads) do
    for name, _ in pairs(t) do t[name] = t[name] + thread:get("n_" .. name) end
  end
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
               + summary.errors.status + summary.errors.timeout
  io.write(string.format('WRKJSON {"requests": %%d, "seconds": %%f, "errors": %%d, ' ..
    '"p50_ms": %%f, "p90_ms": %%f, "p99_ms": %%f, "tiers": {"exact": %%d, "semantic": %%d, ' ..
    '"coalesced": %%d, "miss": %%d, "bypass": %%d, "other": %%d}}\\n',
    summary.requests, summary.duration / 1e6, errors, latency:percentile(50) / 1000,
    latency:percentile(90) / 1000, latency:percentile(99) / 1000,
    t.exact, t.semantic, t.coalesced, t.miss, t.bypass, t.other))
end
"""


# ---------------------------------------------------------------- helpers

def log(message: str) -> None:
    print(message, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def summary_ms(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99),
            "mean_ms": statistics.fmean(values) if values else None}


def chat(text: str, stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    if stream:
        body["stream"] = True
    return body


def encode(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def paraphrase_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get(
        "SLUICE_PARAPHRASE", report.ROOT.parent / "shared" / "data" / "paraphrase" / "dev.jsonl"))


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series over the samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def sidecar_metrics(stack: Stack) -> str:
    return httpx.get(f"http://127.0.0.1:{stack.ports.metrics}/metrics", timeout=5).text


def upstream_requests(stack: Stack, name: str) -> int:
    return httpx.get(f"http://127.0.0.1:{stack.upstream_port(name)}/admin/stats", timeout=5).json()["requests"]


def wrk_rotate(url: str, bodies: list[bytes], connections: int, seconds: float) -> dict:
    """wrk over `bodies` in turn (one thread), with the x-sluice-cache tiers it saw."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "bodies.jsonl"
        path.write_bytes(b"\n".join(bodies) + b"\n")
        script = pathlib.Path(tmp) / "rotate.lua"
        script.write_text(ROTATE_LUA % {"bodies": path})
        return wrk.run_script(url, script, connections, seconds)


# ---------------------------------------------------------------- the replayed stream

def load_pairs(path: pathlib.Path, count: int, rng: random.Random) -> list[dict]:
    by_source: dict[str, list[dict]] = collections.defaultdict(list)
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row["a"].strip() and row["b"].strip() and row["a"] != row["b"]:
                by_source[row["source"]].append(row)
    chosen = []
    for i, source in enumerate(SOURCES):
        take = count // len(SOURCES) + (1 if i < count % len(SOURCES) else 0)
        chosen += rng.sample(by_source[source], take)
    rng.shuffle(chosen)
    return chosen


def build_stream(pairs: list[dict], extra: int, s: float, rng: random.Random) -> list[dict]:
    """Each pair's a, then its b, then Zipf-drawn repeats of either, at random times."""
    ranks = list(range(1, len(pairs) + 1))
    rng.shuffle(ranks)                                   # popularity rank of each pair
    weights = [r ** -s for r in ranks]
    counts = [2] * len(pairs)
    for i in rng.choices(range(len(pairs)), weights=weights, k=extra):
        counts[i] += 1
    timed = []
    for i, count in enumerate(counts):
        times = sorted(rng.random() for _ in range(count))
        roles = ["a", "b"] + [rng.choice("ab") for _ in range(count - 2)]
        timed += [(t, i, role) for t, role in zip(times, roles)]
    timed.sort()
    return [{"pair": i, "role": role, "text": pairs[i][role], "source": pairs[i]["source"],
             "id": pairs[i]["id"]} for _, i, role in timed]


async def reference_answers(port: int, texts: list[str]) -> dict[str, str]:
    """The answer the demo engine gives each prompt, asked of the reference upstream directly."""
    answers: dict[str, str] = {}
    gate = asyncio.Semaphore(32)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(text: str) -> None:
            async with gate:
                r = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                      content=encode(chat(text)), headers=HEADERS)
                r.raise_for_status()
                answers[text] = r.json()["choices"][0]["message"]["content"]
        await asyncio.gather(*(one(t) for t in texts))
    return answers


def warm_up(url: str) -> None:
    """First-use costs (connections, lazy imports, the first model runs) out of the way."""
    with httpx.Client(timeout=30) as client:
        for n in range(3):
            client.post(url, content=encode(chat(f"warm-up request number {n}")), headers=HEADERS)


def replay(url: str, stream: list[dict]) -> None:
    """Send the stream one request at a time; fill tier, latency, content per request."""
    with httpx.Client(timeout=30) as client:
        for item in stream:
            body = encode(chat(item["text"]))
            started = time.perf_counter()
            r = client.post(url, content=body, headers=HEADERS)
            data = r.content
            item["ms"] = 1000 * (time.perf_counter() - started)
            item["status"] = r.status_code
            item["tier"] = r.headers.get("x-sluice-cache", "none")
            sim = r.headers.get("x-sluice-similarity")
            item["similarity"] = float(sim) if sim else None
            item["content"] = json.loads(data)["choices"][0]["message"]["content"] if r.status_code == 200 else None


def judge(stream: list[dict], pairs: list[dict], truth: dict[str, str]) -> None:
    """For every answered-from-cache request: whose answer was it, and was that right?"""
    labels: dict[frozenset, int] = {}
    for pair in pairs:                  # a text pair listed twice counts as label 1 if either says so
        key = frozenset((pair["a"], pair["b"]))
        labels[key] = max(pair["label"], labels.get(key, 0))
    by_content: dict[str, list[str]] = collections.defaultdict(list)
    for text, content in truth.items():
        by_content[content].append(text)
    for item in stream:
        item["verdict"] = None
        if item["tier"] not in ("exact", "semantic", "coalesced"):
            continue
        if item["content"] == truth[item["text"]]:
            item["verdict"] = "own"
            continue
        sources = by_content.get(item["content"], [])
        found = [labels.get(frozenset((item["text"], other))) for other in sources]
        item["served_from"] = sources[0] if sources else None
        if 1 in found:
            item["verdict"] = "label1"
        elif 0 in found:
            item["verdict"] = "false:label0"
        elif sources:
            item["verdict"] = "false:unpaired"
        else:
            item["verdict"] = "false:unknown"


def quality(items: list[dict]) -> dict:
    n = len(items)
    tiers = collections.Counter(i["tier"] for i in items)
    semantic = [i for i in items if i["tier"] == "semantic"]
    false_sem = [i for i in semantic if (i["verdict"] or "").startswith("false")]
    false_any = [i for i in items if (i["verdict"] or "").startswith("false")]
    upstream = tiers["miss"] + tiers["bypass"] + tiers["none"]
    # First arrival of each b: did it hit a's answer, by label?
    firsts, seen = [], set()
    for i in items:
        if i["role"] == "b" and i["pair"] not in seen:
            seen.add(i["pair"])
            firsts.append(i)
    b_by_label = {}
    for label in (1, 0):
        group = [i for i in firsts if i["label"] == label]
        hits = [i for i in group if i["tier"] in ("semantic", "coalesced")]
        b_by_label[f"label{label}"] = {"b_first": len(group), "hits": len(hits),
                                       "hit_rate": len(hits) / len(group) if group else None}
    return {
        "requests": n, "tiers": {t: tiers.get(t, 0) for t in (*TIERS, "none")},
        "exact_hit_rate": tiers["exact"] / n if n else None,
        "semantic_hit_rate": tiers["semantic"] / n if n else None,
        "coalesced_rate": tiers["coalesced"] / n if n else None,
        "false_semantic_hits": len(false_sem),
        # The same prompts repeat (Zipf): the distinct prompts behind the hits.
        "semantic_hit_prompts_distinct": len({i["text"] for i in semantic}),
        "false_semantic_prompts_distinct": len({i["text"] for i in false_sem}),
        "false_hit_rate": len(false_sem) / len(semantic) if semantic else None,
        "false_hits_per_1000": 1000 * len(false_sem) / n if n else None,
        "false_hits_any_tier": len(false_any),
        "false_kinds": dict(collections.Counter(i["verdict"] for i in false_any)),
        "wrong_exact_hits": sum(1 for i in items if i["tier"] == "exact" and i["verdict"] != "own"),
        "upstream_saved": 1 - upstream / n if n else None,
        "b_first_arrival": b_by_label,
    }


# ---------------------------------------------------------------- streamed misses

def ttft_phase(stack: Stack, texts: list[str]) -> dict:
    urls = {"cache": f"{stack.base_url}/chat/completions",
            "no_cache": f"http://127.0.0.1:{stack.ports.http}/nocache/v1/chat/completions"}
    expected = {"cache": "miss", "no_cache": "bypass"}
    results = {arm: {"ttft": [], "total": [], "tiers": collections.Counter()} for arm in urls}
    with httpx.Client(timeout=30) as client:
        def one(arm: str, text: str, record: bool) -> None:
            started = time.perf_counter()
            first = None
            with client.stream("POST", urls[arm], content=encode(chat(text, stream=True)),
                               headers=HEADERS) as r:
                tier = r.headers.get("x-sluice-cache", "none")
                for line in r.iter_lines():
                    if first is None and line.startswith("data: ") and line != "data: [DONE]":
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        if choices[0].get("delta", {}).get("content"):
                            first = time.perf_counter()
            end = time.perf_counter()
            if record:
                results[arm]["tiers"][tier if r.status_code == 200 else f"status {r.status_code}"] += 1
                if tier == expected[arm] and first is not None:
                    results[arm]["ttft"].append(1000 * (first - started))
                    results[arm]["total"].append(1000 * (end - started))

        for n in range(2):
            for arm in urls:
                one(arm, f"streaming warm-up {n} for the {arm} route", record=False)
        for n, text in enumerate(texts):
            order = ("cache", "no_cache") if n % 2 == 0 else ("no_cache", "cache")
            for arm in order:                        # the same fresh prompt on both routes
                one(arm, text, record=True)
    return {arm: {"ttft": summary_ms(r["ttft"]), "total": summary_ms(r["total"]),
                  "tiers": dict(r["tiers"])} for arm, r in results.items()}


# ---------------------------------------------------------------- the embedder alone

def embedder_rates_on_sidecar_loop(texts: list[str], clients: list[int], seconds: float) -> dict[str, dict]:
    """embedder_rates on the event loop the sidecar runs on, so the two rates compared differ
    only by what a hit adds."""
    return sidecar_loop.run(embedder_rates(texts, clients, seconds))


async def embedder_rates(texts: list[str], clients: list[int], seconds: float) -> dict[str, dict]:
    """The embedder's texts/s at each number of closed-loop callers (one loaded model)."""
    from sidecar.embedding import EmbeddingService, EmbeddingSettings
    service = EmbeddingService(EmbeddingSettings.from_env())
    await service.warm_up()
    try:
        return {str(c): await _embedder_rate(service, texts, c, seconds) for c in clients}
    finally:
        await service.close()


async def _embedder_rate(service, texts: list[str], clients: int, seconds: float) -> dict:
    async def closed_loop(duration: float) -> tuple[int, float]:
        done, cursor = 0, iter(range(10**9))
        deadline = time.perf_counter() + duration

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await service.embed(texts[next(cursor) % len(texts)])
                done += 1
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done, time.perf_counter() - started

    await closed_loop(1.0)                            # warm-up
    cpu_before = time.process_time()
    done, elapsed = await closed_loop(seconds)
    return {"clients": clients, "texts": done, "seconds": elapsed, "texts_per_s": done / elapsed,
            "cpu_ms_per_text": 1000 * (time.process_time() - cpu_before) / max(1, done),
            "settings": dataclasses.asdict(service.settings)}


def embed_report_reference() -> dict | None:
    """The batcher as served, at 32 clients, from reports/embed.json (bench.embed), when present."""
    from sidecar.embedding import EmbeddingSettings
    threads = EmbeddingSettings.from_env().intra_op_threads
    path = report.ROOT / "reports" / "embed.json"
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return None
    for row in rows:
        if row.get("mode") == "batcher" and row.get("clients") == 32 and row.get("threads") == threads:
            return {"texts_per_s": row["texts_per_s"], "time": json.loads(path.read_text()).get("time")}
    return None


# ---------------------------------------------------------------- main

def routes(max_false_hit_rate: float | None = None) -> list[dict]:
    """The no-cache route and the cached one (with the verifier's rate when given: the
    "after" of a before/after replay)."""
    candidates = [{"cluster": "upstream_a", "weight": 1}]
    no_cache = chat_route("nocache", "/nocache/", candidates, rewrite="/")
    no_cache["metadata"]["filter_metadata"]["sluice"]["cache"] = {"enabled": False}
    cached = chat_route("cached", "/", candidates)
    if max_false_hit_rate is not None:
        cached["metadata"]["filter_metadata"]["sluice"].setdefault("cache", {})["max_false_hit_rate"] = \
            max_false_hit_rate
    return [no_cache, cached]


def run_cache_stack(work: pathlib.Path, args, pairs, stream, ttft_texts, exact_bodies, noop_url: str) -> dict:
    out: dict = {}
    stack = Stack(work / "cache", routes=routes(args.max_false_hit_rate), envoy_vars=overhead.NO_RATE_LIMIT,
                  upstream_args={"a": REPLAY_UPSTREAM, "b": REFERENCE_UPSTREAM},
                  sidecar_env={"SLUICE_CACHE": "true"})
    with stack:
        pid = stack.procs["sidecar"].pid
        out["rss_start_mb"] = report.rss_mb(pid)
        url = f"{stack.base_url}/chat/completions"

        log(f"[1/4] reference answers for {len({i['text'] for i in stream})} prompts (upstream b, directly)")
        texts = sorted({p[r] for p in pairs for r in ("a", "b")})
        truth = asyncio.run(reference_answers(stack.upstream_port("b"), texts))

        log(f"[1/4] replaying {len(stream)} requests through Envoy, one at a time")
        warm_up(url)
        before = upstream_requests(stack, "a")
        started = time.perf_counter()
        replay(url, stream)
        out["replay_seconds"] = time.perf_counter() - started
        out["upstream_requests"] = upstream_requests(stack, "a") - before
        judge(stream, pairs, truth)
        out["stored_after_replay"] = metric_sum(sidecar_metrics(stack), "sluice_cache_stored_total")

        # Paraphrases that hit their original semantically: the semantic wrk workload.
        semantic_texts = list(dict.fromkeys(i["text"] for i in stream if i["tier"] == "semantic"))
        out["semantic_texts"] = len(semantic_texts)
        semantic_bodies = [encode(chat(t)) for t in semantic_texts]

        log(f"[2/4] wrk: exact hits (two bodies), in turns with the no-op sidecar, and semantic hits "
            f"at concurrency {', '.join(map(str, CONCURRENCY))}")
        out["wrk_exact"], out["wrk_noop"], out["exact_body_check"] = {}, {}, {}
        pids = {"sidecar": pid, "envoy": stack.procs["envoy"].pid}
        for name, body in exact_bodies.items():
            tiers = [httpx.post(url, content=body, headers=HEADERS, timeout=30).headers.get("x-sluice-cache")
                     for _ in range(2)]                                 # the first stores it
            out["exact_body_check"][name] = tiers
            wrk.run(url, body, 16, 1)                                   # warm-up
            wrk.run(noop_url, body, 16, 1)

            def exact_run(c: int, body=body) -> dict:
                m0 = metric_sum(sidecar_metrics(stack), "sluice_cache_requests_total", result="exact")
                point = with_cpu(pids, lambda: wrk.run(url, body, c, duration(args, c)))
                point["exact_in_metrics"] = metric_sum(sidecar_metrics(stack), "sluice_cache_requests_total",
                                                       result="exact") - m0
                return point
            runs = turns.in_turns({"exact": exact_run,
                                   "noop": lambda c, body=body: wrk.run(noop_url, body, c, duration(args, c))},
                                  CONCURRENCY, args.turns)
            out["wrk_exact"][name], out["wrk_noop"][name] = runs["exact"], runs["noop"]
        out["wrk_semantic"] = [semantic_point(url, semantic_bodies, c, duration(args, c), pids)
                               for c in CONCURRENCY] if semantic_bodies else []

        clients = [c for c in CONCURRENCY if c > 1]
        log(f"[3/4] the embedder alone in this process: {clients} clients, {args.embed_seconds:g} s each")
        out["embedder"] = embedder_rates_on_sidecar_loop(semantic_texts or texts, clients, args.embed_seconds)

        log(f"[4/4] streamed misses: {len(ttft_texts)} fresh prompts on the cached and the cache-off route")
        httpx.post(f"http://127.0.0.1:{stack.upstream_port('a')}/admin/config", json=STREAM_CONFIG,
                   timeout=5).raise_for_status()
        out["ttft"] = ttft_phase(stack, ttft_texts)
        out["rss_after_mb"] = report.rss_mb(pid)
        out["sidecar_cache_metrics"] = {
            t: metric_sum(sidecar_metrics(stack), "sluice_cache_requests_total", result=t) for t in TIERS}
    return out


def semantic_point(url: str, bodies: list[bytes], concurrency: int, seconds: float, pids: dict) -> dict:
    """wrk over the semantic bodies (they are semantic hits: the tiers seen say so), with the
    CPU time each request took (with_cpu)."""
    return with_cpu(pids, lambda: {"concurrency": concurrency, **wrk_rotate(url, bodies, concurrency, seconds)})


def with_cpu(pids: dict, run) -> dict:
    """run()'s wrk point, and the CPU time each of its requests took: the sidecar's event loop
    (its main thread), its other threads (the model's, gRPC's) and Envoy, in ms per request."""
    def sample() -> dict:
        return {"event_loop": report.cpu_seconds(pids["sidecar"], pids["sidecar"]),
                "sidecar": report.cpu_seconds(pids["sidecar"]), "envoy": report.cpu_seconds(pids["envoy"])}
    before = sample()
    point = run()
    spent = {k: v - before[k] for k, v in sample().items()}
    per = 1000 / max(1, point["requests"])
    point["cpu_ms_per_request"] = {"sidecar_event_loop": spent["event_loop"] * per,
                                   "sidecar_other_threads": (spent["sidecar"] - spent["event_loop"]) * per,
                                   "envoy": spent["envoy"] * per}
    return point


def duration(args, concurrency: int) -> float:
    return args.seconds if concurrency > 1 else args.seconds_c1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=PAIRS)
    parser.add_argument("--extra", type=int, default=EXTRA, help="Zipf-drawn repeats")
    parser.add_argument("--zipf", type=float, default=ZIPF_S)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--max-false-hit-rate", type=float, default=None,
                        help="the cached route's max_false_hit_rate (default: the route default)")
    parser.add_argument("--seconds", type=float, default=4.0, help="wrk duration at concurrency 16/64")
    parser.add_argument("--seconds-c1", type=float, default=3.0, help="wrk duration at concurrency 1")
    parser.add_argument("--embed-seconds", type=float, default=3.0)
    parser.add_argument("--turns", type=int, default=3, help="turns of exact hits and the no-op per point")
    args = parser.parse_args()
    began = time.perf_counter()
    load_at_start = os.getloadavg()

    rng = random.Random(args.seed)
    path = paraphrase_path()
    pairs = load_pairs(path, args.pairs, rng)
    stream = build_stream(pairs, args.extra, args.zipf, rng)
    for item in stream:
        item["label"] = pairs[item["pair"]]["label"]
    used = {p[r] for p in pairs for r in ("a", "b")}
    # Fresh prompts for the streamed misses: other pairs' a, never seen by the cache.
    fresh = load_pairs(path, 3 * TTFT_PROMPTS, random.Random(args.seed + 1))
    ttft_texts = [p["a"] for p in fresh
                  if p["a"] not in used and not time_sensitive_word(p["a"])][:TTFT_PROMPTS]
    exact_bodies = {"2kb": overhead.chat_body(), "short": encode(chat(SHORT_PROMPT))}

    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        with overhead.bench_stack(work / "noop", ["--noop"]) as baseline:
            cache = run_cache_stack(work, args, pairs, stream, ttft_texts, exact_bodies,
                                    f"{baseline.base_url}/chat/completions")
        noop = cache["wrk_noop"]

    print()
    print(f"1. quality: {len(pairs)} pairs ({path.name}), {len(stream)} requests (each pair's a then b, "
          f"+{args.extra} Zipf(s={args.zipf}) repeats), one at a time, {cache['replay_seconds']:.0f} s")
    quality_out = print_quality(stream, cache)
    print("\n2. latency through Envoy at concurrency 1 (replay: httpx client, upstream ttft 50 ms; "
          "wrk: 1 connection)")
    latency_out = print_latency(stream, cache, noop)
    print(f"\n3. throughput, wrk 1 thread, {args.seconds:g} s per point (exact hits and the no-op: median "
          f"of {args.turns} turns each); exact bodies "
          + ", ".join(f"{k} = {len(v)} bytes" for k, v in exact_bodies.items())
          + f"; {cache['semantic_texts']} rotating paraphrase bodies")
    throughput_out = print_throughput(cache, noop)
    print(f"\n4. streamed misses (upstream ttft {STREAM_CONFIG['ttft_ms']:.0f} ms, {STREAM_CONFIG['tokens']} "
          f"tokens at {STREAM_CONFIG['tokens_per_s']:.0f}/s), ms; the same fresh prompts on both routes")
    ttft_out = print_ttft(cache["ttft"])
    print(f"\n5. sidecar RSS: start {cache['rss_start_mb']:.0f} MiB (model loaded, cache empty), "
          f"after the run {cache['rss_after_mb']:.0f} MiB ({cache['stored_after_replay']:.0f} answers stored "
          f"by the replay)")
    goals = goal_verdicts(latency_out, throughput_out)
    print("\ngoals:")
    for verdict in goals.values():
        print(f"  {'met   ' if verdict['met'] else 'MISSED'}  {verdict['goal']}: {_short(verdict['value'])}")

    data = {
        "settings": {"pairs": len(pairs), "extra_zipf_requests": args.extra, "zipf_s": args.zipf,
                     "seed": args.seed, "max_false_hit_rate": args.max_false_hit_rate,
                     "pairs_file": str(path), "replay_upstream": REPLAY_UPSTREAM,
                     "stream_upstream": STREAM_CONFIG, "wrk_seconds": args.seconds,
                     "wrk_seconds_c1": args.seconds_c1,
                     "exact_body_bytes": {k: len(v) for k, v in exact_bodies.items()},
                     "semantic_bodies": cache["semantic_texts"], "embed_clients": [c for c in CONCURRENCY if c > 1]},
        "quality": quality_out,
        "latency_c1": latency_out,
        "throughput": throughput_out,
        "ttft_streamed_miss": ttft_out,
        "sidecar_rss_mb": {"start": cache["rss_start_mb"], "after_run": cache["rss_after_mb"]},
        "sidecar_cache_metrics": cache["sidecar_cache_metrics"],
        "goals": goals,
        "runtime_s": time.perf_counter() - began,
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
    }
    print(f"load average (1 min) at start {load_at_start[0]:.2f}, at end {data['load_average']['end'][0]:.2f}; "
          f"wrote {report.write('cache', data)} in {data['runtime_s']:.0f} s")
    return 0


def print_quality(stream: list[dict], cache: dict) -> dict:
    overall = quality(stream)
    per_source = {s: quality([i for i in stream if i["source"] == s]) for s in SOURCES}
    saved_stats = 1 - cache["upstream_requests"] / len(stream)
    rows = []
    for name, q in (("all", overall), *per_source.items()):
        rows.append({"source": name, "requests": q["requests"], "exact %": 100 * q["exact_hit_rate"],
                     "semantic %": 100 * q["semantic_hit_rate"], "coalesced": q["tiers"]["coalesced"],
                     "bypass": q["tiers"]["bypass"], "false sem": q["false_semantic_hits"],
                     "false/sem %": _pct(q["false_hit_rate"]), "false/1000": q["false_hits_per_1000"],
                     "saved %": 100 * q["upstream_saved"],
                     "b1 hit %": _pct(q["b_first_arrival"]["label1"]["hit_rate"]),
                     "b0 hit %": _pct(q["b_first_arrival"]["label0"]["hit_rate"])})
    print(report.table(rows, list(rows[0])))
    print(f"upstream calls saved (upstream /admin/stats): {100 * saved_stats:.1f}% "
          f"({cache['upstream_requests']} upstream requests for {len(stream)} client requests)")
    print("false sem: semantic hits that served the answer of a label-0 partner or of an unpaired prompt; "
          "b1/b0 hit %: the first arrival of b was answered from the cache, label-1 / label-0 pairs")
    false_items = [i for i in stream if (i["verdict"] or "").startswith("false")]
    distinct = list({(i["text"], i.get("served_from")): i for i in false_items}.values())
    print(f"semantic hits: {overall['tiers']['semantic']} requests from {overall['semantic_hit_prompts_distinct']} "
          f"distinct prompts, of which {overall['false_semantic_prompts_distinct']} false")
    if false_items:
        print(f"false hits: {len(false_items)} requests, {len(distinct)} distinct prompts; kinds "
              f"{dict(collections.Counter(i['verdict'] for i in false_items))}")
        for i in distinct[:10]:
            print(f"  {i['tier']} sim={i['similarity']} {i['verdict']} [{i['source']} {i['id']}] "
                  f"{i['text'][:60]!r} <- {(i.get('served_from') or '?')[:60]!r}")
    sims = {v: [i["similarity"] for i in stream if i["tier"] == "semantic" and (i["verdict"] or "").startswith(v)]
            for v in ("label1", "false", "own")}
    return {"overall": overall, "per_source": per_source,
            "upstream_requests": cache["upstream_requests"], "client_requests": len(stream),
            "upstream_saved_from_stats": saved_stats,
            "semantic_similarity": {k: {"n": len(v), "min": min(v) if v else None, "max": max(v) if v else None}
                                    for k, v in sims.items()},
            "false_hits": [{"id": i["id"], "source": i["source"], "tier": i["tier"], "role": i["role"],
                            "label": i["label"], "kind": i["verdict"], "similarity": i["similarity"]}
                           for i in false_items]}


def print_latency(stream: list[dict], cache: dict, noop: dict) -> dict:
    replay_lat = {t: summary_ms([i["ms"] for i in stream if i["tier"] == t]) for t in TIERS}
    wrk_c1 = {f"exact_{k}": v[0] for k, v in cache["wrk_exact"].items()}
    if cache["wrk_semantic"]:
        wrk_c1["semantic"] = cache["wrk_semantic"][0]
    wrk_c1.update({f"noop_{k}": v[0] for k, v in noop.items()})
    rows = [{"what": f"replay: {t}", "n": v["n"], "p50 ms": v["p50_ms"], "p99 ms": v["p99_ms"]}
            for t, v in replay_lat.items() if v["n"]]
    rows += [{"what": f"wrk: {label(t)}", "n": v["requests"], "p50 ms": v["p50_ms"], "p99 ms": v["p99_ms"]}
             for t, v in wrk_c1.items()]
    print(report.table(rows, ["what", "n", "p50 ms", "p99 ms"]))
    return {"replay": replay_lat, "wrk": {k: _point(v) for k, v in wrk_c1.items()}}


def print_throughput(cache: dict, noop: dict) -> dict:
    rows = []
    series = [(label(f"noop_{k}"), v) for k, v in noop.items()]
    series += [(label(f"exact_{k}"), v) for k, v in cache["wrk_exact"].items()]
    series.append((label("semantic"), cache["wrk_semantic"]))
    for name, points in series:
        for p in points:
            if p["concurrency"] == 1:
                continue
            tiers = p.get("tiers")
            seen = (" ".join(f"{k}={v}" for k, v in tiers.items() if v) if tiers else
                    f"exact={p['exact_in_metrics']:.0f} (metrics)" if "exact_in_metrics" in p else "")
            rows.append({"workload": name, "concurrency": p["concurrency"], "req/s": p["rps"],
                         "p50 ms": p["p50_ms"], "p99 ms": p["p99_ms"], "errors": p["errors"], "tiers seen": seen})
    print(report.table(rows, ["workload", "concurrency", "req/s", "p50 ms", "p99 ms", "errors", "tiers seen"]))
    embed_rates = {c: e["texts_per_s"] for c, e in cache["embedder"].items()}
    reference = embed_report_reference()
    exact_over_noop = {body: {str(p["concurrency"]): turns.ratio(p, q)
                              for p, q in zip(points, noop[body]) if p["concurrency"] > 1}
                       for body, points in cache["wrk_exact"].items()}
    semantic_over_embed = {str(p["concurrency"]): p["rps"] / embed_rates[str(p["concurrency"])]
                           for p in cache["wrk_semantic"] if p["concurrency"] > 1}
    print("embedder alone (this process, the same texts, stack idle), texts/s: "
          + ", ".join(f"{c} clients: {r:.0f}" for c, r in embed_rates.items())
          + (f" (reports/embed.json, batcher, 32 clients: {reference['texts_per_s']:.0f})" if reference else ""))
    for body, ratios in exact_over_noop.items():
        print(f"exact hit / noop req/s, {body} body: " + ", ".join(f"c={c}: {r:.2f}" for c, r in ratios.items()))
    print("semantic hit req/s / embedder texts/s: "
          + (", ".join(f"c={c}: {r:.2f}" for c, r in semantic_over_embed.items()) or "no semantic hits"))
    exact_cpu = {str(p["concurrency"]): p["cpu_ms_per_request"] for p in cache["wrk_exact"].get("short", [])
                 if "cpu_ms_per_request" in p}
    ceiling = {}
    for p in cache["wrk_semantic"]:
        c, cpu = str(p["concurrency"]), p["cpu_ms_per_request"]
        if c in cache["embedder"]:
            alone = cache["embedder"][c]["cpu_ms_per_text"]
            print(f"CPU ms per request of the semantic workload, c={c}: sidecar event loop {cpu['sidecar_event_loop']:.2f}, sidecar "
                  f"other threads (model, gRPC) {cpu['sidecar_other_threads']:.2f}, Envoy {cpu['envoy']:.2f}; "
                  f"embedder alone {alone:.2f} per text (this process, all threads)")
            if c in exact_cpu:
                x = exact_cpu[c]
                print(f"CPU ms per exact hit (short body), c={c}: sidecar event loop {x['sidecar_event_loop']:.2f}, "
                      f"other threads {x['sidecar_other_threads']:.2f}, Envoy {x['envoy']:.2f}")
                ceiling[c] = alone / (alone + sum(x.values()))
    if ceiling:
        # On a box whose cores the model fills, a semantic hit costs at least the embedding plus
        # what an exact hit costs (Envoy, gRPC, the request's own handling): this bounds the ratio.
        print("ceiling of semantic hit req/s / embedder texts/s, were a semantic hit to cost only the "
              "embedder's CPU plus an exact hit's (wrk's own CPU aside): "
              + ", ".join(f"c={c}: {r:.2f}" for c, r in ceiling.items()))
    return {"noop": {k: [_point(p) for p in v if p["concurrency"] > 1] for k, v in noop.items()},
            "exact": {k: [_point(p) for p in v if p["concurrency"] > 1] for k, v in cache["wrk_exact"].items()},
            "semantic": [_point(p) for p in cache["wrk_semantic"] if p["concurrency"] > 1],
            "embedder": cache["embedder"], "embedder_reports_embed_json": reference,
            "exact_over_noop_rps": exact_over_noop,
            "semantic_rps_over_embedder_texts_per_s": semantic_over_embed,
            "semantic_ratio_ceiling_from_exact_hit_cpu": ceiling}


def print_ttft(t: dict) -> dict:
    rows = [{"route": arm, "n": v["ttft"]["n"], "ttft p50": v["ttft"]["p50_ms"], "ttft p99": v["ttft"]["p99_ms"],
             "total p50": v["total"]["p50_ms"], "total p99": v["total"]["p99_ms"],
             "x-sluice-cache": " ".join(f"{k}={n}" for k, n in v["tiers"].items())} for arm, v in t.items()]
    print(report.table(rows, list(rows[0])))
    added = {f"{m}_{q}": _diff(t["cache"][m][q], t["no_cache"][m][q])
             for m in ("ttft", "total") for q in ("p50_ms", "p99_ms")}
    print("cache on minus cache off: " + ", ".join(f"{k} {v:+.1f}" for k, v in added.items() if v is not None))
    return {"cache_on": t["cache"], "cache_off": t["no_cache"], "added_ms": added}


def label(key: str) -> str:
    """Printed name of a wrk series key (exact_2kb, noop_short, semantic)."""
    kind, _, body = key.partition("_")
    name = {"exact": "exact hit", "noop": "noop pass-through", "semantic": "semantic hit"}[kind]
    return f"{name}, {body} body" if body else name


def goal_verdicts(latency: dict, throughput: dict) -> dict:
    """The goals by key, each with what it asks (goal), the measured value and whether it was met."""
    goals = {}
    for key, point in latency["wrk"].items():
        if key.startswith("exact_"):
            goals[f"{key}_p99_c1_under_3ms"] = {"goal": f"{label(key)}: p99 at concurrency 1 < 3 ms",
                                                "value": point["p99_ms"], "met": point["p99_ms"] < 3}
    sem = latency["wrk"].get("semantic")
    goals["semantic_p99_c1_under_10ms"] = {"goal": "semantic hit: p99 at concurrency 1 < 10 ms",
                                           "value": sem and sem["p99_ms"], "met": bool(sem) and sem["p99_ms"] < 10}
    for body, ratios in throughput["exact_over_noop_rps"].items():
        goals[f"exact_{body}_rps_at_least_noop"] = {"goal": f"{label('exact_' + body)}: req/s >= noop req/s",
                                                    "value": ratios, "met": all(r >= 1 for r in ratios.values())}
    ratios = throughput["semantic_rps_over_embedder_texts_per_s"]
    goals["semantic_rps_at_least_0.8_embedder"] = {
        "goal": "semantic hit req/s >= 0.8 x embedder texts/s", "value": ratios,
        "met": bool(ratios) and all(r >= 0.8 for r in ratios.values())}
    return goals


def _short(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"c={k}: {v:.2f}" for k, v in value.items())
    return "n/a" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _point(p: dict) -> dict:
    keep = ("concurrency", "requests", "seconds", "rps", "p50_ms", "p90_ms", "p99_ms", "errors", "tiers",
            "exact_in_metrics", "rps_turns", "cpu_ms_per_request")
    return {k: p[k] for k in keep if k in p}


if __name__ == "__main__":
    raise SystemExit(main())
