"""Token usage of an upstream answer, read from its JSON body or its SSE stream.

Reuses the cache's capture parsers (sidecar/cache/capture.py): their answer carries the
`usage` the upstream sent, or an estimate from the text when it sent none (a stream whose
client did not ask for `stream_options.include_usage`).
"""
from __future__ import annotations

import time

from sidecar.cache.capture import Refusal, SseCapture, capture_json

MAX_BYTES = 1 << 20


class UsageMeter:
    def __init__(self, stream: bool, prompt_text: str = "", max_bytes: int = MAX_BYTES):
        self._sse = SseCapture(max_bytes) if stream else None
        self._prompt_text = prompt_text   # estimates prompt tokens when the stream has no usage
        self._body = bytearray()
        self._max_bytes = max_bytes
        self._done = False

    def feed(self, chunk: bytes, end_of_stream: bool) -> tuple[int, int] | None:
        """(prompt, completion) tokens once the answer is complete; None before (or never)."""
        if self._done:
            return None
        if self._sse is not None:
            self._sse.feed(chunk)
            finished = end_of_stream or self._sse.done
        else:
            if len(self._body) + len(chunk) <= self._max_bytes:
                self._body += chunk
            finished = end_of_stream
        if not finished:
            return None
        self._done = True
        answer = (self._sse.finish(time.time(), prompt_text=self._prompt_text) if self._sse is not None
                  else capture_json(bytes(self._body), time.time(), prompt_text=self._prompt_text))
        if isinstance(answer, Refusal):
            return None
        return answer.prompt_tokens, answer.completion_tokens
