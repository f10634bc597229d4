"""`sluice cache-check`: would a request with prompt b be served the answer stored for prompt a?

Reads JSONL pairs {"a": ..., "b": ...} on stdin and writes one JSON object per pair:
{"hit": bool, "tier": "exact"|"semantic"|null, "similarity": float|null, "reason": str,
"score": float|null}, where reason names the check that decided and score is the semantic
verifier's P(same question) when it was asked (docs/semantic-quality.md). It runs the server's
own decision code (bypass rules, scope, exact key, embedding, nearest neighbour, same-question
decision: CacheStage.lookup)
on an in-memory store, without Envoy or Redis, under the sidecar-wide settings the server would
read (SLUICE_* variables, SLUICE_CONFIG_FILE: SLUICE_CACHE=false is "cache_off" for every pair,
SLUICE_SEMANTIC=false leaves no semantic tier) and one route's settings: --route NAME (the
route of that name in --envoy-config), --route '{"cache": {...}}' (its sluice metadata as JSON),
or none (the defaults). Exit 2 on bad settings. Over a large file, progress on stderr when it is
a terminal (--progress / --no-progress to choose).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

# What `make run` renders from envoy/envoy.yaml.tmpl.
DEFAULT_ENVOY_CONFIG = Path(__file__).resolve().parents[1] / "build" / "run" / "envoy.yaml"


def add_subcommands(subparsers) -> None:
    check = subparsers.add_parser("cache-check", help="would prompt b hit the entry stored for prompt a?",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("--route", default="{}",
                       help="a route name in --envoy-config, or route settings as JSON (its sluice metadata)")
    check.add_argument("--envoy-config", default=str(DEFAULT_ENVOY_CONFIG),
                       help="Envoy config (YAML or JSON) holding the named route (default: the one `make run` renders)")
    check.add_argument("--model", default="demo-model")
    check.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress on stderr (default: when stderr is a terminal)")
    check.set_defaults(func=lambda args: asyncio.run(_run(args)))


async def _run(args) -> int:
    from sidecar.cache.answer import CachedAnswer
    from sidecar.cache.budget import DEFAULT_BUDGET_BYTES, CacheBudget
    from sidecar.cache.inflight import InFlight
    from sidecar.cache.token_states import TokenStates
    from sidecar.cache.memory_store import MemoryStore
    from sidecar.cache.policy import cache_decision
    from sidecar.cache.scope import exact_key, prompt_text, scope_for
    from sidecar.tenancy import credential_header
    from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage, route_cache
    from sidecar.openai.chat import ChatRequest
    from sidecar.config import ConfigError
    from sidecar.embedding import EmbeddingService, EmbeddingSettings, ModelLoadError
    from sidecar.service.progress import Progress, input_size
    from sidecar.service.reload import load_config
    from sidecar.route_settings import RouteSettingsError, parse_route_settings

    try:
        config = load_config(redis_url="")            # an in-memory store: Redis is not asked
        route = parse_route_settings(_route_metadata(args.route, args.envoy_config))
        settings = route_cache(route)
        semantic = settings.semantic and config.semantic
        embedder = EmbeddingService(EmbeddingSettings.from_env()) if config.cache and semantic else None
        if embedder is not None:
            await embedder.warm_up()
    except (ValueError, TypeError, OSError, RouteSettingsError, ConfigError, ModelLoadError) as exc:
        print(f"sluice cache-check: {exc}", file=sys.stderr)
        return 2
    if not semantic:
        settings = dataclasses.replace(settings, semantic=False)
    answer = CachedAnswer(content="stored answer", finish_reason="stop", model=args.model,
                          prompt_tokens=1, completion_tokens=1, created_at=0.0).to_bytes()
    # The caller's identity where the route reads it (a tenant header Envoy would set).
    headers = {credential_header(settings.policy.tenant_header): "Bearer cache-check"}
    progress = Progress("cache-check: pairs", input_size(sys.stdin), show=args.progress)
    for line_number, line in enumerate(sys.stdin, 1):
        progress.advance(0, len(line.encode()))
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
        runtime = CacheRuntime(store=MemoryStore(), inflight=InFlight(), embedder=embedder,
                               token_states=TokenStates(CacheBudget(DEFAULT_BUDGET_BYTES).token_states))
        stage = CacheStage(runtime)
        chat_a, chat_b = (ChatRequest(model=args.model, messages=({"role": "user", "content": text},))
                          for text in (a, b))
        verdict = (await _check(stage, runtime.secret, settings, chat_a, chat_b, headers, answer,
                                cache_decision, scope_for, prompt_text, exact_key) if config.cache
                   else {"hit": False, "tier": None, "similarity": None, "reason": "cache_off", "score": None})
        print(json.dumps(verdict), flush=True)
        progress.advance()
    progress.done()
    if embedder is not None:
        await embedder.close()
    return 0


def _route_metadata(route: str, envoy_config: str) -> dict:
    """The route's sluice metadata: JSON given as is, or that of the Envoy route of this name."""
    if route.lstrip().startswith("{"):
        metadata = json.loads(route)
        if not isinstance(metadata, dict):
            raise ValueError("--route: expected a JSON object")
        return metadata
    import yaml                                           # JSON is YAML too
    with open(envoy_config, encoding="utf-8") as handle:
        try:
            config = yaml.safe_load(handle)
        except yaml.YAMLError as exc:
            raise ValueError(f"--envoy-config {envoy_config}: not YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--envoy-config {envoy_config}: not an Envoy config")
    names = []
    for envoy_route in _routes(config):
        names.append(envoy_route.get("name"))
        if envoy_route.get("name") == route:
            return _at(envoy_route, "metadata", "filter_metadata", "sluice") or {}
    known = ", ".join(sorted({n for n in names if n})) or "none"
    raise ValueError(f"--route: no route named {route!r} in {envoy_config} (routes: {known})")


def _routes(config: dict):
    """Every route of every listener's HTTP connection manager, skipping what is not one."""
    for listener in _list(_at(config, "static_resources", "listeners")):
        for chain in _list(_at(listener, "filter_chains")):
            for network_filter in _list(_at(chain, "filters")):
                for host in _list(_at(network_filter, "typed_config", "route_config", "virtual_hosts")):
                    yield from (r for r in _list(_at(host, "routes")) if isinstance(r, dict))


def _at(value, *keys):
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _list(value) -> list:
    return value if isinstance(value, list) else []


async def _check(stage, secret, settings, chat_a, chat_b, headers, answer,
                 cache_decision, scope_for, prompt_text, exact_key) -> dict:
    policy = settings.policy
    if not policy.enabled:
        return {"hit": False, "tier": None, "similarity": None, "reason": "disabled", "score": None}
    stored = cache_decision(chat_a, headers, policy)
    if stored is not None and not stored.may_store:
        return {"hit": False, "tier": None, "similarity": None, "reason": f"a_not_stored:{stored.reason}", "score": None}
    bypass = cache_decision(chat_b, headers, policy)
    if bypass is not None:
        return {"hit": False, "tier": None, "similarity": None, "reason": bypass.reason, "score": None}
    scope = scope_for(chat_a, headers, policy, secret)
    prompt_a, prompt_b = prompt_text(chat_a), prompt_text(chat_b)
    vector_a, states_a = await stage.embed_prompt(prompt_a, policy) if settings.semantic else (None, None)
    await stage.store(scope.key, exact_key(scope, prompt_a), prompt_a, vector_a, states_a, answer, policy.ttl_s)
    found = await stage.lookup(scope.key, exact_key(scope, prompt_b), prompt_b, settings)
    similarity = found.similarity
    if similarity is None and vector_a is not None and found.vector is not None:
        similarity = float(np.dot(vector_a, found.vector))
    return {"hit": found.tier is not None, "tier": found.tier,
            "similarity": None if similarity is None else round(similarity, 4), "reason": found.reason,
            "score": None if found.score is None else round(found.score, 4)}
