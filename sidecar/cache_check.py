"""`sluice cache-check`: would a request with prompt b be served the answer stored for prompt a?

Reads JSONL pairs {"a": ..., "b": ...} on stdin and writes one JSON object per pair:
{"hit": bool, "tier": "exact"|"semantic"|null, "similarity": float|null, "reason": str}, where
reason names the check that decided. It runs the server's own decision code (bypass rules,
scope, exact key, embedding, nearest neighbour, same-question checks: CachingDirector.lookup)
on an in-memory store, without Envoy or Redis. Route settings: --route '{"cache": {...}}'.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np



def add_subcommands(subparsers) -> None:
    check = subparsers.add_parser("cache-check", help="would prompt b hit the entry stored for prompt a?",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("--route", default="{}", help="route settings as JSON (the Envoy route's sluice metadata)")
    check.add_argument("--model", default="demo-model")
    check.set_defaults(func=lambda args: asyncio.run(_run(args)))


async def _run(args) -> int:
    from sidecar.cache.answer import CachedAnswer
    from sidecar.cache.inflight import InFlight
    from sidecar.cache.memory_store import MemoryStore
    from sidecar.cache.policy import cache_decision
    from sidecar.cache.scope import exact_key, prompt_text, scope_for
    from sidecar.caching import CacheRuntime, CachingDirector, route_cache
    from sidecar.chat import ChatRequest
    from sidecar.embedding import EmbeddingService, EmbeddingSettings
    from sidecar.route_settings import RouteSettingsError, parse_route_settings

    try:
        route = parse_route_settings(json.loads(args.route))
        settings = route_cache(route)
    except (ValueError, RouteSettingsError) as exc:
        print(f"sluice cache-check: bad --route: {exc}", file=sys.stderr)
        return 2
    embedder = EmbeddingService(EmbeddingSettings.from_env()) if settings.semantic else None
    if embedder is not None:
        await embedder.warm_up()
    answer = CachedAnswer(content="stored answer", finish_reason="stop", model=args.model,
                          prompt_tokens=1, completion_tokens=1, created_at=0.0).to_bytes()
    headers = {"authorization": "Bearer cache-check"}
    for line_number, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            pair = json.loads(line)
            a, b = pair["a"], pair["b"]
            if not isinstance(a, str) or not isinstance(b, str):
                raise TypeError("a and b must be strings")
        except (ValueError, KeyError, TypeError) as exc:
            print(json.dumps({"error": f"line {line_number}: {exc}"}), flush=True)
            continue
        director = CachingDirector(None, CacheRuntime(store=MemoryStore(), inflight=InFlight(),
                                                      embedder=embedder))
        chat_a, chat_b = (ChatRequest(model=args.model, messages=({"role": "user", "content": text},))
                          for text in (a, b))
        verdict = await _check(director, settings, chat_a, chat_b, headers, answer,
                               cache_decision, scope_for, prompt_text, exact_key)
        print(json.dumps(verdict), flush=True)
    if embedder is not None:
        await embedder.close()
    return 0


async def _check(director, settings, chat_a, chat_b, headers, answer,
                 cache_decision, scope_for, prompt_text, exact_key) -> dict:
    policy = settings.policy
    if not policy.enabled:
        return {"hit": False, "tier": None, "similarity": None, "reason": "disabled"}
    stored = cache_decision(chat_a, headers, policy)
    if stored is not None and not stored.may_store:
        return {"hit": False, "tier": None, "similarity": None, "reason": f"a_not_stored:{stored.reason}"}
    bypass = cache_decision(chat_b, headers, policy)
    if bypass is not None:
        return {"hit": False, "tier": None, "similarity": None, "reason": bypass.reason}
    scope = scope_for(chat_a, headers, policy, director._rt.secret)
    prompt_a, prompt_b = prompt_text(chat_a), prompt_text(chat_b)
    vector_a = await director._embed(prompt_a) if settings.semantic else None
    await director._rt.store.put(scope.key, exact_key(scope, prompt_a), prompt_a, vector_a, answer, policy.ttl_s)
    found = await director.lookup(scope.key, exact_key(scope, prompt_b), prompt_b, settings)
    similarity = found.similarity
    if similarity is None and vector_a is not None and found.vector is not None:
        similarity = float(np.dot(vector_a, found.vector))
    return {"hit": found.tier is not None, "tier": found.tier,
            "similarity": None if similarity is None else round(similarity, 4), "reason": found.reason}
