"""Immediate replies with error bodies in OpenAI's shape, so SDKs raise their usual exceptions."""
from __future__ import annotations

import json

from sidecar.extproc.events import ImmediateReply


def error_reply(status: int, message: str, *, type_: str = "invalid_request_error",
                param: str | None = None, code: str | None = None,
                headers: tuple[tuple[str, str], ...] = ()) -> ImmediateReply:
    body = json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})
    return ImmediateReply(status=status, body=body.encode(),
                          headers=(("content-type", "application/json"), *headers))
