"""Logging setup: one JSON object per line, through named `sluice.*` loggers.

Everything goes to stderr. The request log is not a logger: sidecar/observability/access_log.py writes its own
JSON lines to stdout, whatever SLUICE_LOG_LEVEL says.
"""
from __future__ import annotations

import json
import logging
import logging.config
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        extra = getattr(record, "fields", None)
        if extra:
            entry.update(extra)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "INFO") -> None:
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json"}},
        "loggers": {"sluice": {"handlers": ["stderr"], "level": level.upper(), "propagate": False}},
    })


def set_level(level: str) -> None:
    """Change the level of every sluice.* logger (a config reload)."""
    logging.getLogger("sluice").setLevel(level.upper())


class Throttle:
    """For a warning that can repeat on every request (bad data shared by all replicas): say
    it at most once per `every_s`; a metric should count each occurrence."""

    def __init__(self, every_s: float = 60.0, clock=time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._said_at = float("-inf")

    def due(self) -> bool:
        now = self._clock()
        if now - self._said_at < self._every_s:
            return False
        self._said_at = now
        return True
