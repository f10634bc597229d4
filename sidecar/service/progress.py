"""Progress of long CLI work on stderr, when stderr is a terminal (or when asked).

One line redrawn in place, at most every REDRAW_S: items done, the share of the input read when
its size is known (a file on stdin), the rate, and the time left. Nothing when not shown, so
output piped to a file or a CI log stays clean.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TextIO

REDRAW_S = 0.2


class Progress:
    def __init__(self, label: str, total_bytes: int | None = None, stream: TextIO | None = None,
                 show: bool | None = None, clock=time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.show = _is_terminal(self.stream) if show is None else show
        self.label = label
        self.total_bytes = total_bytes
        self.items = 0
        self.bytes = 0
        self._clock = clock
        self._started = clock()
        self._drawn = self._started     # a first line once there is a rate to show
        self._width = 0

    def advance(self, items: int = 1, nbytes: int = 0) -> None:
        self.items += items
        self.bytes += nbytes
        now = self._clock()
        if self.show and now - self._drawn >= REDRAW_S:
            self._draw(now)

    def done(self) -> None:
        if self.show:
            self._draw(self._clock())
            self.stream.write("\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-9)
        parts = [f"{self.label}: {self.items:,}"]
        if self.total_bytes:
            share = min(self.bytes / self.total_bytes, 1.0)
            parts.append(f"{share:.0%}")
            if 0 < share < 1:
                parts.append(f"{_clock_text(elapsed * (1 - share) / share)} left")
        parts.append(f"{self.items / elapsed:,.1f}/s")
        return ", ".join(parts)

    def _draw(self, now: float) -> None:
        self._drawn = now
        text = self.line(now)
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)


def input_size(stream) -> int | None:
    """Bytes in a regular file behind `stream` (stdin redirected from a file), else None."""
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    import stat
    return info.st_size if stat.S_ISREG(info.st_mode) and info.st_size > 0 else None


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
