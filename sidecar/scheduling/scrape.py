"""Periodic scraping of upstreams' Prometheus metrics (vLLM names) for the queue scorer."""
from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from typing import Callable

from sidecar.scheduling import UpstreamLoad, upstream_load

log = logging.getLogger("sluice.scrape")
MAX_BYTES = 8 << 20      # vLLM's page is ~100 KB a model; a bound, not a size to expect


async def fetch(url: str, timeout_s: float) -> bytes:
    """A minimal HTTP/1.0 GET (plain http only); raises OSError or asyncio.TimeoutError."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:                     # out of range or not a number
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise OSError(f"unsupported metrics URL {url!r}: only http://host:port/path")
    async def get() -> bytes:
        reader, writer = await asyncio.open_connection(parts.hostname, port)
        try:
            path = parts.path or "/"
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
            await writer.drain()
            # To the end of the body: its Content-Length, else the close (HTTP/1.0). One read()
            # returns what has arrived so far, which can end mid-number ("12" read as "1").
            data, length = bytearray(), None
            while chunk := await reader.read(65536):
                data += chunk
                if len(data) > MAX_BYTES:
                    raise OSError(f"metrics at {url} are over {MAX_BYTES} bytes")
                head_end = data.find(b"\r\n\r\n")
                if length is None and head_end >= 0:
                    length = _content_length(bytes(data[:head_end]))
                if length is not None and len(data) - head_end - 4 >= length:
                    break
        finally:
            writer.close()
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.") or b" 200 " not in head.split(b"\r\n", 1)[0] + b" ":
            raise OSError(f"metrics URL {url} answered {head[:40]!r}")
        return body
    return await asyncio.wait_for(get(), timeout_s)


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


class Scraper:
    """One task per (cluster, url); each success is reported through `report`."""

    def __init__(self, report: Callable[[str, UpstreamLoad, float], None], interval_s: float = 2.0,
                 timeout_s: float = 1.0, max_targets: int = 256):
        self._report = report
        self._interval_s, self._timeout_s, self._max_targets = interval_s, timeout_s, max_targets
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}

    def ensure(self, cluster: str, url: str) -> None:
        key = (cluster, url)
        if key not in self._tasks and len(self._tasks) < self._max_targets:
            self._tasks[key] = asyncio.get_running_loop().create_task(self._run(cluster, url))

    async def _run(self, cluster: str, url: str) -> None:
        failing = False
        while True:
            try:
                load = upstream_load(await fetch(url, self._timeout_s))
                if load is not None:
                    self._report(cluster, load, time.monotonic())
                if failing:
                    log.info("metrics of %s reachable again at %s", cluster, url)
                failing = False
            except (OSError, asyncio.TimeoutError) as exc:
                if not failing:   # log transitions, not every failed scrape
                    log.warning("cannot scrape metrics of %s at %s: %s", cluster, url, exc)
                failing = True
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
