"""What serving the token-alignment verifier costs: the states of both prompts, and the verdict.

Run: `make bench-verifier` (= `.venv/bin/python -m bench.verifier_states`); about a minute.

Texts: the chat test suite's prompts (data/semantic/chat-test), one at a time through the
served int8 model's onnxruntime session (the engine's threads), as a lone request runs. The arms take turns in ROUNDS rounds, so
that other load on the machine falls on each alike. Measured, p50 / p99 per text:
  vector only, graph without states  the served graph with its second output removed
                                     (the engine before the verifier read states);
  vector only                        the served graph, states not fetched (every route
                                     without the verifier);
  vector + states                    both outputs of the same run (a route with the verifier);
  recompute: 4 layers                option (a) for the stored candidate: a graph cut after
                                     four layers, run on the candidate's text per request;
  verdict                            same_question with both prompts' states: lexical
                                     features, alignment and the trees (profiles cached, as for
                                     a stored prompt and a repeated new one);
  verdict, new prompts               the same with the checks' profiles forgotten first.
And option (b)'s memory: bytes a stored prompt's states are charged in TokenStates (float16
states, the entry's overhead, its scope and exact keys as the cache stage makes them), mean and p99.

Replicas sharing Redis (a real redis-server on loopback, started here; skipped without one):
  states read from Redis             what a replica pays for a candidate whose states it does
                                     not hold: RedisStore.get_states for the one key, and
                                     decode_states (CacheStage._stored_states without the share);
  entry fetch from Redis             for scale: the fetch every semantic candidate already costs;
and the bytes Redis holds per entry (MEMORY USAGE of its hash) with the states and without, and
the encoded states' own size, mean and p99.
Prints a table, writes reports/verifier_states.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import statistics
import time

import numpy as np

from bench.report import ROOT, table, write
from sidecar.cache.alignment import STATES_LAYERS
from sidecar.cache.equivalence import EquivalenceSettings, forget_profiles
from sidecar.cache.same_question import same_question
from sidecar.cache.scope import exact_key, prompt_text, scope_for
from sidecar.cache.token_states import TokenStates, decode_states, encode_states, max_encoded_bytes
from sidecar.embedding.loader import load
from sidecar.embedding.model_files import resolve_files
from sidecar.embedding.runtime import open_session
from sidecar.embedding.settings import EmbeddingSettings

ROUNDS = 5
TEXTS = 200


def chat_texts() -> list[str]:
    texts = []
    for path in sorted((ROOT / "data" / "semantic" / "chat-test").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                pair = json.loads(line)
                texts += [pair["a"], pair["b"]]
    return list(dict.fromkeys(texts))


def _session_with_outputs(model_path, keep: list[str], settings: EmbeddingSettings):
    """The served graph cut down to what `keep` needs (with the states alone: the first four
    layers; onnxruntime itself keeps every node of a graph, needed or not)."""
    import tempfile
    from pathlib import Path

    import onnx
    import onnx.utils
    model = onnx.load(str(model_path))
    cut = onnx.utils.Extractor(model).extract_model([i.name for i in model.graph.input], keep)
    with tempfile.NamedTemporaryFile(suffix=".onnx") as handle:
        onnx.save(cut, handle.name)
        return open_session(Path(handle.name), "cpu", settings.intra_op_threads)


def _timed(fn, items) -> list[float]:
    out = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - start)
    return out


def _row(name: str, seconds: list[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    return {"arm": name, "p50_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))], "n": len(ms)}


def _charged(per_text: dict) -> list[int]:
    """What TokenStates charges for each text's states, under the keys a request makes."""
    from sidecar.cache.policy import CachePolicy
    from sidecar.openai.chat import ChatRequest
    from sidecar.tenancy import credential_header
    held, sizes, policy = TokenStates(1 << 40), [], CachePolicy()
    headers = {credential_header(policy.tenant_header): "Bearer bench"}
    for text, states in per_text.items():
        chat = ChatRequest(model="gpt-4o-mini", messages=({"role": "user", "content": text},))
        scope = scope_for(chat, headers, policy, b"k" * 32, route="chat")
        before = held.nbytes
        held.put(scope.key, exact_key(scope, prompt_text(chat)), states)
        sizes.append(held.nbytes - before)
    return sizes


async def _shared(per_text: dict, vectors: dict, rounds: int) -> tuple[dict[str, list[float]], dict]:
    """Through a real Redis: the states read's time and the bytes an entry holds there."""
    from pathlib import Path

    from sidecar.cache.redis_store import RedisSettings, RedisStore
    from tests.support.redis_server import RedisServer
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(Path(workdir)).start()
        store = RedisStore(RedisSettings(url=server.url, timeout_s=1.0, connect_timeout_s=1.0))
        try:
            await store.start()
            keys, encoded = {}, []
            for n, (text, states) in enumerate(per_text.items()):
                keys[text] = f"k{n}"
                encoded.append(len(data := encode_states(states)))
                await store.put("with", keys[text], text, vectors[text], b"x" * 600, 3600, states=data)
                await store.put("without", keys[text], text, vectors[text], b"x" * 600, 3600)
            dim = next(iter(per_text.values())).shape[1]
            times: dict[str, list[float]] = {"states read from Redis": [], "entry fetch from Redis": []}
            for _ in range(rounds):
                for key in keys.values():
                    start = time.perf_counter()
                    decode_states((await store.get_states("with", [key], max_encoded_bytes(dim)))[0], dim)
                    times["states read from Redis"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    await store.get_exact("with", key)
                    times["entry fetch from Redis"].append(time.perf_counter() - start)
            usage = {scope: np.array([await store._client.memory_usage(store._keys.entry(scope, key), samples=0)
                                      for key in keys.values()]) for scope in ("with", "without")}
        finally:
            await store.close()
            server.stop()
    return times, {"redis_entry_bytes_mean": int(usage["with"].mean()),
                   "redis_entry_bytes_p99": int(np.percentile(usage["with"], 99)),
                   "redis_entry_bytes_without_states_mean": int(usage["without"].mean()),
                   "encoded_states_bytes_mean": int(np.mean(encoded)),
                   "encoded_states_bytes_p99": int(np.percentile(encoded, 99))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=TEXTS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    settings = EmbeddingSettings.from_env()
    model = load(settings)
    encoder = model.encoder
    if not encoder.has_states:
        raise SystemExit("the served model has no token_states output: run `make all`")
    files = resolve_files(settings)
    texts = chat_texts()[:args.texts]
    ids = [encoder.tokenize(t) for t in texts]
    names = {i.name for i in encoder.session.get_inputs()}
    feeds = [{k: v for k, v in (("input_ids", np.array([i])), ("attention_mask", np.ones((1, len(i)), np.int64)),
                                ("token_type_ids", np.zeros((1, len(i)), np.int64))) if k in names} for i in ids]
    without = _session_with_outputs(files.model, ["last_hidden_state"], settings)
    cut = _session_with_outputs(files.model, ["token_states"], settings)
    per_text = {t: s for t, s in zip(texts, [encoder.run_with_states([i])[1][0] for i in ids])}
    pairs = [(texts[k], texts[k + 1]) for k in range(0, len(texts) - 1, 2)]
    rate = EquivalenceSettings(max_false_hit_rate=0.02)

    def verdict(pair):
        a, b = pair
        same_question(a, b, 0.95, rate, layer_states=(per_text[a], per_text[b]))

    def verdict_new(pair):
        forget_profiles()
        verdict(pair)

    arms = {
        "vector only, graph without states": lambda f: without.run(None, f),
        "vector only": lambda f: encoder.session.run(["last_hidden_state"], f),
        "vector + states": lambda f: encoder.session.run(["last_hidden_state", "token_states"], f),
        "recompute: 4 layers": lambda f: cut.run(None, f),
    }
    inputs = dict.fromkeys(arms, feeds)
    times: dict[str, list[float]] = {name: [] for name in [*arms, "verdict", "verdict, new prompts"]}
    for name, fn in arms.items():          # warm each arm
        _timed(fn, inputs[name][:10])
    for _ in range(args.rounds):
        for name, fn in arms.items():
            times[name] += _timed(fn, inputs[name])
        times["verdict"] += _timed(verdict, pairs)
        times["verdict, new prompts"] += _timed(verdict_new, pairs)
    shared = {}
    if shutil.which("redis-server") is not None:
        vectors = {t: encoder.run([i])[0] for t, i in zip(texts, ids)}
        redis_times, shared = asyncio.run(_shared(per_text, vectors, args.rounds))
        times.update(redis_times)
    else:
        print("no redis-server: the shared-store arms are skipped (`make system-deps`)")
    rows = [_row(name, seconds) for name, seconds in times.items()]
    sizes = np.array(_charged(per_text))
    tokens = np.array([len(i) for i in ids])
    memory = {"states_layers": STATES_LAYERS, "tokens_mean": round(float(tokens.mean()), 1),
              "bytes_per_prompt_mean": int(sizes.mean()), "bytes_per_prompt_p99": int(np.percentile(sizes, 99)),
              "vector_bytes": int(encoder.run([ids[0]]).nbytes)}
    print(table(rows, ["arm", "p50_ms", "p99_ms", "n"]))
    print(f"\nstored states (option b): {memory}")
    if shared:
        print(f"in Redis, per entry: {shared}")
    path = write("verifier_states", {"texts": len(texts), "rounds": args.rounds, "rows": rows, "memory": memory, "redis": shared,
                                     "intra_op_threads": settings.intra_op_threads})
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
