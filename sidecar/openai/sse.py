"""Server-sent events out of a byte stream that arrives in arbitrary pieces.

The EventSource rules that matter for chat streams: lines end in LF, CRLF or a lone CR and
may be split anywhere across feed() calls (a CRLF too); one UTF-8 BOM at the start of the
stream is dropped; the `data:` lines of one event are joined with "\\n"; an empty line ends
an event; lines starting with ":" are comments; `event:` names the event.
Keeps only the event being read. Pure: no I/O.
"""
from __future__ import annotations


_BOM = b"\xef\xbb\xbf"


class SseEvents:
    def __init__(self) -> None:
        self._line = b""                     # an incomplete line
        self._data: list[bytes] = []         # data lines of the event being read
        self._event = b""                    # its `event:` field
        self._started = False                # past a possible BOM
        self._after_cr = False               # the last chunk ended in CR: a LF next is its CRLF

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes]]:
        """(event name, data) of each event this chunk completes, in order."""
        if not chunk:
            return []
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        text = self._line + chunk
        if not self._started:
            if len(text) < len(_BOM) and _BOM.startswith(text):
                self._line = text            # too short to tell yet
                return []
            self._started = True
            text = text.removeprefix(_BOM)
        self._after_cr = text.endswith(b"\r")
        if b"\r" in text:
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = text.split(b"\n")
        self._line = lines.pop()
        events = []
        for line in lines:
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
