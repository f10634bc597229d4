"""Sidecar-wide settings from a file, and their reload while the sidecar runs.

Sources, later ones winning: defaults, SLUICE_* environment variables, the file named by
SLUICE_CONFIG_FILE (KEY=VALUE lines, `#` comments, optional quotes, as in k8s/base/sidecar.env),
command-line flags. SIGHUP re-reads them (and, with SLUICE_CONFIG_WATCH_S > 0, a change of the
file does); what can change live (LIVE_FIELDS) is applied without touching open streams, other
changes are logged as needing a restart. A bad file (unreadable, a malformed line, an unknown
key, a bad value) keeps the running settings and logs why, naming the line or the field.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Callable

from sidecar.observability import metrics
from sidecar.config import ENV_PREFIX, ConfigError, SidecarConfig

log = logging.getLogger("sluice.config")
LIVE_FIELDS = ("log_level", "access_log", "log_prompts")
FILE_KEYS = frozenset(ENV_PREFIX + f.name.upper() for f in fields(SidecarConfig)) - {"SLUICE_CONFIG_FILE"}


def read_config_file(path: str) -> dict[str, str]:
    """SLUICE_* settings of a KEY=VALUE file; ConfigError names the file, line and key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config_file: cannot read {path}: {exc}") from None
    values = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"config_file {path}:{number}: expected KEY=VALUE")
        if key not in FILE_KEYS:
            hint = " (SLUICE_EMBED_* are read from the environment only)" if key.startswith("SLUICE_EMBED_") else ""
            raise ConfigError(f"config_file {path}:{number}: {key} is not a sidecar-wide setting{hint}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def load_config(environ=os.environ, **overrides) -> SidecarConfig:
    """Defaults, the environment, the config file, then `overrides` (CLI flags; None = unset)."""
    path = overrides.get("config_file") or environ.get(ENV_PREFIX + "CONFIG_FILE", "")
    if path:
        environ = {**environ, **read_config_file(path)}
    return SidecarConfig.from_env(environ, **overrides)


class Reloader:
    """Holds the running settings; `reload()` re-reads and applies what can change live."""

    def __init__(self, current: SidecarConfig, load: Callable[[], SidecarConfig],
                 apply: Callable[[SidecarConfig], None]) -> None:
        self.current = current
        self._load = load
        self._apply = apply

    def reload(self, why: str = "SIGHUP") -> bool:
        try:
            new = self._load()
        except ConfigError as exc:
            metrics.CONFIG_RELOADS.labels("error").inc()
            log.error("config reload (%s) failed, keeping the running settings: %s", why, exc)
            return False
        changed = [f.name for f in fields(SidecarConfig) if getattr(new, f.name) != getattr(self.current, f.name)]
        live = [name for name in changed if name in LIVE_FIELDS]
        restart = [name for name in changed if name not in LIVE_FIELDS]
        if restart:
            log.warning("config reload (%s): %s changed but need a restart; keeping the running values",
                        why, ", ".join(restart))
        self.current = self.current.replace(**{name: getattr(new, name) for name in live})
        self._apply(self.current)
        metrics.CONFIG_RELOADS.labels("ok").inc()
        log.info("config reloaded (%s): %s", why,
                 ", ".join(f"{name}={getattr(self.current, name)!r}" for name in live) or "nothing changed live")
        return True

    async def watch(self, path: str, interval_s: float) -> None:
        """Reload whenever the file changes (checked every interval_s; a k8s ConfigMap update
        swaps a symlink, which changes what stat() sees)."""
        seen = _signature(path)
        while True:
            await asyncio.sleep(interval_s)
            now = _signature(path)
            if now != seen:
                seen = now
                self.reload("file changed")


def _signature(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino
