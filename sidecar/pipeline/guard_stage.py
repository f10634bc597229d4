"""The guard stage: the guard's checks before every other stage of the request path.

Per chat request on a route with guard settings: scan the checked messages (words, personal data); a `block` answers 400 at once;
masks and redactions rewrite the body, and the parsed request with it, so the cache key, the
cache entry, the upstream and the request log all see only the rewritten prompt; then the
injection classifier scores the embedding of the last user turn (the one the semantic cache
uses: sidecar/guard/embeddings.py hands it over, no second model run). Flags travel to the
upstream in x-sluice-guard.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from sidecar.observability import metrics as sidecar_metrics
from sidecar.cache.equivalence import EquivalenceSettings
from sidecar.openai.chat import BadRequest, forget_parsed, parse_chat_request
from sidecar.request.context import Outcome, RequestContext
from sidecar.extproc.events import Plan
from sidecar.guard import metrics
from sidecar.guard.check import Finding, header_value, judge_injection, rewrite_body, scan, scrubbing
from sidecar.guard.policy import GuardPolicy, build_policy
from sidecar.memo import may_keep
from sidecar.extproc.errors import error_reply
from sidecar.route_settings import PerSettings, RouteSettings

log = logging.getLogger("sluice.guard")
_CACHE_MAX_PROMPT_CHARS = EquivalenceSettings().max_prompt_chars
GUARD_HEADER = "x-sluice-guard"
SCAN_OFF_LOOP_BYTES = 32 * 1024


@dataclass
class GuardState:
    """The guard's piece of a request: what it found (no text), and whether it is done."""
    findings: list[Finding] = field(default_factory=list)
    reply: Plan | None = None
    injection_due: bool = False          # the injection classifier is still to be asked


# A request on a route without guard settings: nothing found, nothing due (never mutated).
UNGUARDED = GuardState()


class GuardStage:
    """The first stage of the pipeline (sidecar/pipeline/exchange.py): scan, then the injection check."""

    def __init__(self, embedder=None, injection_head=None):
        self._embedder = embedder            # sidecar.guard.embeddings.SharedEmbeddings, or None
        self._head = injection_head
        self._policy_of = PerSettings()
        self._generation = 0

    def reload(self) -> None:
        """Re-read word files (SIGHUP): every policy is built again on its next request."""
        self._generation += 1

    # --- decision -----------------------------------------------------------------------

    def scan_now(self, ctx: RequestContext) -> GuardState | None:
        """Words and personal data; None for a large body, which `scan` reads off the loop."""
        policy = self._policy(ctx)
        if policy is None:
            return UNGUARDED
        if len(ctx.body) > SCAN_OFF_LOOP_BYTES:
            return None
        return self._scan(ctx, policy)

    async def scan(self, ctx: RequestContext) -> GuardState:
        policy = self._policy(ctx)
        if policy is None:
            return UNGUARDED
        if len(ctx.body) > SCAN_OFF_LOOP_BYTES:
            # A large body (~30 ms a megabyte, more for pathological digit runs) is scanned
            # off the event loop, so the other streams' messages are answered meanwhile.
            return await asyncio.to_thread(self._scan, ctx, policy)
        return self._scan(ctx, policy)

    async def check_injection(self, ctx: RequestContext, state: GuardState) -> None:
        """The injection classifier on the last user turn's embedding (state.injection_due)."""
        state.injection_due = False
        finding = await self._injection(ctx, self._policy(ctx))
        if finding is not None:
            self._count(ctx, finding)
            state.findings.append(finding)
            if finding.action == "block":
                state.reply = self._blocked(ctx, finding)

    # --- the checks ---------------------------------------------------------------------

    def _policy(self, ctx: RequestContext) -> GuardPolicy | None:
        route = ctx.route
        if not isinstance(route, RouteSettings) or not route.HasField("guard"):
            return None
        return self._policy_of.get(route, self._build, ctx.route_name, self._generation)

    def _build(self, route: RouteSettings, route_name: str, _generation: int) -> GuardPolicy | None:
        try:
            return build_policy(route.guard, self._head)
        except ValueError as exc:
            # A guard that cannot be built must not let its route through unchecked.
            log.error("invalid guard settings of route %s, refusing its requests: %s", route_name, exc)
            return _BROKEN

    def _scan(self, ctx: RequestContext, policy: GuardPolicy) -> GuardState:
        """Words and personal data, once per request (the exchange keeps the state)."""
        state = GuardState(injection_due=policy.injection is not None)
        if policy is _BROKEN:
            state.reply = Plan(reply=error_reply(
                503, "the guard settings of this route are invalid; see the sidecar's log",
                type_="server_error", code="guard_misconfigured"))
            ctx.outcome = Outcome.REFUSED
            state.injection_due = False
            return state
        started = time.perf_counter()
        result = scan(policy, ctx.chat.messages)
        for finding in result.findings:
            self._count(ctx, finding)
        state.findings = result.findings
        blocking = result.blocking
        if blocking is not None:
            state.reply = self._blocked(ctx, blocking)
            state.injection_due = False
            scrubbed = scan(scrubbing(policy), ctx.chat.messages).rewrites
            if scrubbed:        # the request log must not keep what blocked it either
                self._rewrite(ctx, scrubbed)
        elif result.rewrites:
            self._rewrite(ctx, result.rewrites)
        metrics.SECONDS.observe(time.perf_counter() - started)
        return state

    @staticmethod
    def _rewrite(ctx: RequestContext, rewrites) -> None:
        """The request from here on is the rewritten one: body, parsed request, cache key."""
        original = ctx.body
        ctx.body = rewrite_body(original, rewrites)
        try:
            ctx.chat = parse_chat_request(ctx.body, remember=False)
        except BadRequest:          # cannot happen for a body that parsed: only texts changed
            raise
        forget_parsed(original)     # the parse memo must not keep what the guard removed

    async def _injection(self, ctx: RequestContext, policy: GuardPolicy) -> Finding | None:
        parts = ctx.chat.prompt_parts
        if parts is None:
            metrics.UNCHECKED.labels(ctx.route_name, "no_user_text").inc()
            return None
        if self._embedder is None:
            return self._text_only(ctx, policy, parts.text, "no_model")
        # Longer prompts are embedded for the guard alone (the cache compares no prompt past
        # its max_prompt_chars): the model reads their last 256 tokens, where an order
        # appended to a pasted document sits. Their vector is not kept for the cache.
        keep = may_keep(ctx.headers) and len(parts.text) <= _CACHE_MAX_PROMPT_CHARS
        try:
            vector = await self._embedder.embed(parts.text, keep=keep)
        except Exception as exc:   # NothingToEmbed, EmbeddingUnavailable (queue full, not ready), any other
            return self._text_only(ctx, policy, parts.text, type(exc).__name__)
        return judge_injection(policy, self._injection_head().score(vector, parts.text), embedded=True)

    def _text_only(self, ctx: RequestContext, policy: GuardPolicy, text: str, reason: str) -> Finding | None:
        """No embedding: the n-gram model judges the prompt alone, at its own threshold."""
        score = self._injection_head().score(None, text)
        (metrics.UNCHECKED if score is None else metrics.TEXT_ONLY).labels(ctx.route_name, reason).inc()
        return judge_injection(policy, score, embedded=False)

    def _injection_head(self):
        if self._head is None:
            from sidecar.guard.injection import default_head
            self._head = default_head()
        return self._head

    @staticmethod
    def _count(ctx: RequestContext, finding: Finding) -> None:
        sidecar_metrics.child(metrics.FINDINGS, ctx.route_name, finding.detector, finding.action).inc()

    @staticmethod
    def _blocked(ctx: RequestContext, finding: Finding) -> Plan:
        ctx.outcome = Outcome.BAD_REQUEST
        what = "prompt injection" if finding.detector == "injection" else (
            f"denied words of list {finding.rule!r}" if finding.detector == "word" else f"personal data ({finding.detector})")
        return Plan(reply=error_reply(400, f"the request was blocked by the content guard: {what}",
                                      code="content_filtered", param="messages"))

    @staticmethod
    def passed_on(ctx: RequestContext, state: GuardState, plan: Plan) -> Plan:
        """The later stages' plan with what the guard changed: the rewritten body, its flags."""
        if plan.reply is not None:
            return plan
        rewritten = plan.body
        if rewritten is None and ctx.body is not None and state.findings and any(
                f.action in ("mask", "redact") for f in state.findings):
            rewritten = ctx.body
        if not state.findings:
            return plan
        headers = plan.request_headers + ((GUARD_HEADER, header_value(state.findings)),)
        return replace(plan, body=rewritten, request_headers=headers)


_BROKEN = GuardPolicy()
