"""Logging setup: one JSON object per line, through named `sluice.*` loggers.

Everything goes to stderr, except the request log (`sluice.access`, sidecar/access_log.py),
which goes to stdout at INFO whatever SLUICE_LOG_LEVEL says: it formats its own JSON line, so
its handler writes the message as it is.
"""
from __future__ import annotations

import json
import logging
import logging.config


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
        "formatters": {"json": {"()": JsonFormatter}, "line": {"format": "%(message)s"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json"},
                     "stdout": {"class": "logging.StreamHandler", "formatter": "line",
                                "stream": "ext://sys.stdout"}},
        "loggers": {"sluice": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
                    "sluice.access": {"handlers": ["stdout"], "level": "INFO", "propagate": False}},
    })


def set_level(level: str) -> None:
    """Change the level of every sluice.* logger but the request log (a config reload)."""
    logging.getLogger("sluice").setLevel(level.upper())
