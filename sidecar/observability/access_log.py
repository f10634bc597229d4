"""The request log: one JSON line per request on stdout when its ext_proc stream ends.

Fields: request id (x-request-id), route, cluster, outcome, cache status, HTTP status, time from
sending the request upstream to its response headers, total duration since the request headers
reached the sidecar (both ms), model, stream flag, trace id, and `why`: the decision record
(sidecar/request/decision_record.py). Never the Authorization header, the prompt or the completion; with
log_prompts on, the last user turn, cut to PROMPT_CHARS characters. The same lines go to
`sluice admin tail` readers (sidecar/observability/record_feed.py), also with the log itself off.

It runs for every request (1-2k/s per sidecar), so the line is built as one dict, serialised
once and written straight to a buffered stdout, flushed at most every FLUSH_S (like Envoy's own
access log): through the `logging` machinery with a flush per line it cost ~160k instructions a
request, a sixth of the sidecar's routing work. `enabled` and `log_prompts` change on a reload.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Callable, TextIO

from sidecar.openai.chat import message_text
from sidecar.request.context import RequestContext
from sidecar.request.decision_record import record
from sidecar.observability.record_feed import RecordFeed

PROMPT_CHARS = 200
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))   # one for every line
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"))
FLUSH_S = 1.0


class LineWriter:
    """Lines kept in memory and written to a stream together: when FLUSH_S has passed since the
    last write (checked on each line and by the server's periodic `flush()`), when MAX_LINES are
    waiting, and on close. It owns its buffer: stdout may be unbuffered (PYTHONUNBUFFERED)."""

    MAX_LINES = 512

    def __init__(self, stream: TextIO | None = None, flush_s: float = FLUSH_S, clock=time.monotonic) -> None:
        self._stream = stream
        self._flush_s = flush_s
        self._clock = clock
        self._flushed = clock()
        self._lines: list[str] = []

    def __call__(self, line: str) -> None:
        self._lines.append(line)
        if len(self._lines) >= self.MAX_LINES or self._clock() - self._flushed >= self._flush_s:
            self.flush()

    def flush(self) -> None:
        self._flushed = self._clock()
        if not self._lines:
            return
        text = "\n".join(self._lines) + "\n"
        self._lines.clear()
        stream = self._stream if self._stream is not None else sys.stdout   # stdout as it is now
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):   # stdout closed or gone: the log must not fail requests
            pass


STDOUT = LineWriter()


class AccessLog:
    def __init__(self, enabled: bool = True, log_prompts: bool = False, clock=time.monotonic,
                 wall_clock=time.time, write: Callable[[str], None] | None = None,
                 feed: RecordFeed | None = None) -> None:
        self.enabled = enabled
        self.feed = feed if feed is not None else RecordFeed()
        self.log_prompts = log_prompts
        self.write = write if write is not None else STDOUT
        self._clock = clock
        self._wall_clock = wall_clock
        self._second = -1
        self._second_text = ""

    @property
    def wanted(self) -> bool:
        """Whether anyone reads the lines: stdout, or a `sluice admin tail`."""
        return self.enabled or self.feed.active

    def emit(self, ctx: RequestContext, trace_id: str | None = None, sent_at: float | None = None) -> None:
        """sent_at: when the request went upstream (the route stage's), for its time to first byte."""
        if self.wanted:
            entry = self.entry(ctx, trace_id, sent_at)
            line = _ENCODER.encode(entry)
            if not line.isascii() and not _utf8(line):
                # A lone surrogate (a model name or prompt can carry one) would fail the write
                # of every line buffered with it: this one is escaped instead.
                line = _ASCII_ENCODER.encode(entry)
            if self.enabled:
                self.write(line)
            if self.feed.active:
                self.feed.publish(entry, line)

    def flush(self) -> None:
        flush = getattr(self.write, "flush", None)
        if flush is not None:
            flush()

    def entry(self, ctx: RequestContext, trace_id: str | None = None, sent_at: float | None = None) -> dict:
        now = self._clock()
        chat = ctx.chat
        sent = sent_at or ctx.started
        ttfb = ctx.response_headers_at - sent if ctx.response_headers_at is not None else None
        entry = {
            "time": self._time(), "logger": "sluice.access", "message": "request",
            "request_id": ctx.request_id, "route": ctx.route_name, "cluster": ctx.cluster,
            "outcome": ctx.outcome.value if ctx.outcome is not None else None,
            "cache": ctx.cache_status, "status": ctx.status, "response_read": ctx.response_read,
            "ttfb_ms": _ms(ttfb), "duration_ms": _ms(now - ctx.started),
            "model": ctx.logged_model,
            "stream": chat.stream if chat is not None else None,
            "trace_id": trace_id,
        }
        why = record(ctx)
        if why:
            entry["why"] = why
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


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
