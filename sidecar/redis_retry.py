"""One retry for a Redis call whose pooled connection was closed while idle.

The server (Redis `timeout`, a managed Redis's idle limit) or a NAT / load balancer closes idle
connections; the next command on one fails with ConnectionError and the pool drops it. That is
no outage: the call is tried once more, on a fresh connection. A Redis that is really away fails
again at once (connection refused). Timeouts are not retried: the caller's deadline covers both
tries. Used by the answer cache, cross-replica dedup and the token limiter, each of which
otherwise sets Redis aside for a while after one failure.

A connection lost after the command ran but before its reply runs it twice: a put or a stream
event written again (idempotent), or a token budget charged twice for one request, once.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError


async def once_more_on_a_closed_connection(call: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await call()
    except RedisConnectionError:
        return await call()
