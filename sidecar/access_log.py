"""The request log: one JSON line per request when its ext_proc stream ends (logger sluice.access).

Fields: request id (x-request-id), route, cluster, outcome, cache status, HTTP status, time from
sending the request upstream to its response headers, total duration since the request headers
reached the sidecar (both ms), model, stream flag, trace id. Never the Authorization header, the prompt or the
completion; with log_prompts on, the last user turn, cut to PROMPT_CHARS characters.

It runs for every request (1-2k/s per sidecar), so the line is built as one dict and serialised
once; sidecar.logs writes it as it is. `enabled` and `log_prompts` change on a config reload.
"""
from __future__ import annotations

import json
import logging
import time

from sidecar.chat import message_text
from sidecar.context import RequestContext

LOG = logging.getLogger("sluice.access")
PROMPT_CHARS = 200


class AccessLog:
    def __init__(self, enabled: bool = True, log_prompts: bool = False, clock=time.monotonic,
                 wall_clock=time.time) -> None:
        self.enabled = enabled
        self.log_prompts = log_prompts
        self._clock = clock
        self._wall_clock = wall_clock
        self._second = -1
        self._second_text = ""

    def emit(self, ctx: RequestContext, trace_id: str | None = None) -> None:
        if self.enabled and LOG.isEnabledFor(logging.INFO):
            LOG.info(json.dumps(self.entry(ctx, trace_id), ensure_ascii=False, separators=(",", ":")))

    def entry(self, ctx: RequestContext, trace_id: str | None = None) -> dict:
        now = self._clock()
        chat = ctx.chat
        sent = getattr(ctx, "sent_at", None) or ctx.started     # when the request went upstream
        ttfb = ctx.response_headers_at - sent if ctx.response_headers_at is not None else None
        entry = {
            "time": self._time(), "logger": "sluice.access", "message": "request",
            "request_id": ctx.request_id, "route": ctx.route_name, "cluster": ctx.cluster,
            "outcome": ctx.outcome.value if ctx.outcome is not None else None,
            "cache": ctx.cache_status, "status": ctx.status,
            "ttfb_ms": _ms(ttfb), "duration_ms": _ms(now - ctx.started),
            "model": chat.model if chat is not None else None,
            "stream": chat.stream if chat is not None else None,
            "trace_id": trace_id,
        }
        if self.log_prompts and chat is not None:
            entry["prompt"] = last_user_turn(chat.messages)[:PROMPT_CHARS]
        return entry

    def _time(self) -> str:
        """Local time as the other log lines write it (2025-01-31 12:00:00,123); the formatted
        second is reused, as most requests share it with the one before."""
        now = self._wall_clock()
        second = int(now)
        if second != self._second:
            self._second, self._second_text = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._second_text},{int((now - second) * 1000):03d}"


def last_user_turn(messages) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_text(message)
    return ""


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
