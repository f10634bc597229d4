"""Server-sent events out of a byte stream that arrives in arbitrary pieces.

The EventSource rules that matter for chat streams: lines end in LF or CRLF and may be split
anywhere across feed() calls; the `data:` lines of one event are joined with "\\n"; an empty
line ends an event; lines starting with ":" are comments; `event:` names the event.
Keeps only the event being read. Pure: no I/O.
"""
from __future__ import annotations


class SseEvents:
    def __init__(self) -> None:
        self._line = b""                     # an incomplete line
        self._data: list[bytes] = []         # data lines of the event being read
        self._event = b""                    # its `event:` field

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes]]:
        """(event name, data) of each event this chunk completes, in order."""
        lines = (self._line + chunk).split(b"\n")
        self._line = lines.pop()
        events = []
        for line in lines:
            line = line.removesuffix(b"\r")
            if not line:
                if self._data or self._event:
                    events.append((self._event, b"\n".join(self._data)))
                self._data, self._event = [], b""
            elif not line.startswith(b":"):
                name, _, value = line.partition(b":")
                value = value.removeprefix(b" ")
                if name == b"data":
                    self._data.append(value)
                elif name == b"event":
                    self._event = value
        return events

    @property
    def pending(self) -> bytes:
        """The data of an event not ended yet, its last line possibly incomplete (a stream
        whose last event lacks the blank line after it)."""
        return b"\n".join(self._data + [self._line])

    @property
    def buffered(self) -> int:
        """Bytes held for the event being read (a bound for callers that cap memory)."""
        return len(self._line) + sum(len(d) for d in self._data)
