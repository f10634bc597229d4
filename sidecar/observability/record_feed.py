"""Live request records for `sluice admin tail`: the request log's lines, handed to readers.

Publishing costs nothing while no one reads (the request log builds no line it does not need).
Each reader has its own queue, bounded in bytes: a reader that falls behind loses the oldest
records (counted, and told), so a slow terminal never holds requests or memory.
"""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

MAX_READERS = 8
READER_BYTES = 1 << 20          # per reader: ~1,000 records of ~1 KB


@dataclass(frozen=True)
class Filter:
    route: str = ""
    cluster: str = ""
    outcome: str = ""

    def matches(self, entry: dict) -> bool:
        return ((not self.route or entry.get("route") == self.route)
                and (not self.cluster or entry.get("cluster") == self.cluster)
                and (not self.outcome or entry.get("outcome") == self.outcome))


@dataclass(eq=False)
class Reader:
    filter: Filter
    lines: collections.deque = field(default_factory=collections.deque)
    size: int = 0
    dropped: int = 0
    closed: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line)
        while self.size > READER_BYTES and len(self.lines) > 1:
            self.size -= len(self.lines.popleft())
            self.dropped += 1
        self.wake.set()

    async def next(self) -> tuple[str, int] | None:
        """(line, records dropped before it), or None once the feed is closed."""
        while not self.lines:
            if self.closed:
                return None
            self.wake.clear()
            await self.wake.wait()
        line = self.lines.popleft()
        self.size -= len(line)
        dropped, self.dropped = self.dropped, 0
        return line, dropped


class RecordFeed:
    def __init__(self) -> None:
        self._readers: set[Reader] = set()
        self.closed = False

    @property
    def active(self) -> bool:
        return bool(self._readers)

    def subscribe(self, filter: Filter) -> Reader | None:
        """A new reader; None when MAX_READERS already read or the feed is closed."""
        if self.closed or len(self._readers) >= MAX_READERS:
            return None
        reader = Reader(filter)
        self._readers.add(reader)
        return reader

    def unsubscribe(self, reader: Reader) -> None:
        self._readers.discard(reader)

    def publish(self, entry: dict, line: str) -> None:
        for reader in self._readers:
            if reader.filter.matches(entry):
                reader.offer(line)

    def close(self) -> None:
        """Ends every reader's stream (the sidecar is draining)."""
        self.closed = True
        for reader in self._readers:
            reader.closed = True
            reader.wake.set()
