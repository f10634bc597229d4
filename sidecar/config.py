"""Sidecar-wide settings: typed, validated once at start, from SLUICE_* variables and the CLI.

Per-route settings do not live here: SREs write them in Envoy's route metadata
(proto/sluice/v1/route_settings.proto).
"""
from __future__ import annotations

import dataclasses
import math
import os
import urllib.parse
from dataclasses import dataclass, fields

ENV_PREFIX = "SLUICE_"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")   # sidecar/service/event_loop.py
ON_INTERNAL_ERROR = ("refuse", "continue")   # sidecar/extproc/processor.py RequestProcessor.fail


class ConfigError(ValueError):
    """A setting is invalid; the message names it."""


@dataclass(frozen=True)
class SidecarConfig:
    listen: str = "127.0.0.1:50051"        # gRPC ext_proc + health
    metrics_listen: str = "127.0.0.1:9464"  # Prometheus /metrics; "" disables
    drain_delay_s: float = 0.0   # on SIGTERM: NOT_SERVING for this long before refusing streams
    grace_s: float = 10.0        # then open streams get this long to finish
    log_level: str = "INFO"       # DEBUG, INFO, WARNING or ERROR (the request log is written whatever it says)
    log_prompts: bool = False    # prompts are never logged unless an operator turns this on
    cache: bool = True           # the answer cache and in-flight dedup (routes can still opt out)
    semantic: bool = True        # load the embedding model for the semantic tier
    redis_url: str = ""          # shared tiers across replicas; "" keeps everything in memory
    redis_cluster: bool = False  # redis_url names one node of a Redis Cluster (keys are slot-safe)
    # One Redis round trip's deadline (cache, dedup, rate limits): past it the request goes on
    # without the shared tier. 50 ms suits Redis in the same zone; raise it for one further away.
    redis_timeout_s: float = 0.05
    cache_secret: str = ""       # HMAC key for tenant ids; replicas sharing Redis need the same one
    cache_max_entries: int = 100_000  # answers the in-process store keeps; one scope holds at most 20,000
    # The in-process cache's byte budget, whatever the mix of scopes (entries, answers, vectors,
    # each scope's index; with Redis, the local tier and the mirror of the shared vectors).
    cache_max_mib: float = 256.0
    admission_reserved_slots: int = 0  # per cluster, only for the highest priority class (see GateConfig)
    access_log: bool = True      # one JSON line per request on stdout
    config_file: str = ""        # KEY=VALUE file of SLUICE_* settings, re-read on SIGHUP
    config_watch_s: float = 0.0  # also re-read it when it changes, checked this often; 0: SIGHUP only
    otlp_endpoint: str = ""      # OpenTelemetry spans over OTLP/gRPC, e.g. http://collector:4317; "" off
    trace_sample_ratio: float = 0.1  # share of the traces the sidecar starts that are sampled
    admin_remote: bool = False   # the Admin gRPC service also answers non-loopback peers
    event_loop: str = "auto"     # auto: uvloop when installed; uvloop (required) or asyncio
    # A request whose handling raises (a bug) before it is decided: refuse (an OpenAI-shaped 500;
    # it never passes admission and limits undecided) or continue (upstream, undecided).
    on_internal_error: str = "refuse"

    def __post_init__(self) -> None:
        for name in ("listen", "metrics_listen"):
            value = getattr(self, name)
            if value and not _is_host_port(value):
                raise ConfigError(f"{name}: expected HOST:PORT, got {value!r}")
        for name in ("drain_delay_s", "grace_s", "config_watch_s"):
            if not _finite_non_negative(getattr(self, name)):     # NaN would sleep forever
                raise ConfigError(f"{name}: must be a number >= 0")
        if not (_finite_non_negative(self.redis_timeout_s) and 0 < self.redis_timeout_s <= 10):
            raise ConfigError(f"redis_timeout_s: must be in (0, 10], got {self.redis_timeout_s!r}")
        if self.admission_reserved_slots < 0:
            raise ConfigError("admission_reserved_slots: must be >= 0")
        if self.cache_max_entries < 1:
            raise ConfigError("cache_max_entries: must be >= 1")
        if not (_finite_non_negative(self.cache_max_mib) and self.cache_max_mib >= 1):
            raise ConfigError(f"cache_max_mib: must be a number >= 1, got {self.cache_max_mib!r}")
        if self.cache_secret and len(self.cache_secret.encode()) < 16:
            raise ConfigError("cache_secret: must be at least 16 bytes")
        if self.redis_url and not _is_redis_url(self.redis_url):
            raise ConfigError(f"redis_url: expected redis://[:password@]host:port/db, rediss://... or "
                              f"unix://..., got {redacted_url(self.redis_url)!r}")
        if self.redis_url and not self.cache_secret:
            # Else each replica draws its own key: the same caller is another tenant on every
            # replica, so the shared cache is never shared and rate limits multiply.
            raise ConfigError("cache_secret: replicas sharing Redis (SLUICE_REDIS_URL or REDIS_URL) "
                              "need the same SLUICE_CACHE_SECRET (at least 16 bytes)")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: expected DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"otlp_endpoint: expected http://HOST:PORT or https://HOST:PORT, got {self.otlp_endpoint!r}")
        if self.on_internal_error not in ON_INTERNAL_ERROR:
            raise ConfigError(f"on_internal_error: expected one of {', '.join(ON_INTERNAL_ERROR)}, "
                              f"got {self.on_internal_error!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"event_loop: expected one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError(f"trace_sample_ratio: must be in [0, 1], got {self.trace_sample_ratio!r}")

    @property
    def metrics_address(self) -> tuple[str, int]:
        """(host, port) of metrics_listen for an HTTP server: an IPv6 host without its brackets."""
        host, _, port = self.metrics_listen.rpartition(":")
        return host.removeprefix("[").removesuffix("]"), int(port)

    @classmethod
    def from_env(cls, environ=os.environ, **overrides) -> "SidecarConfig":
        """Defaults, then SLUICE_<FIELD> variables, then explicit overrides (CLI flags)."""
        values = {}
        for field in fields(cls):
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = _convert(field, raw)
        if "redis_url" not in values and environ.get("REDIS_URL"):
            values["redis_url"] = environ["REDIS_URL"]          # the conventional name works too
        values.update({k: v for k, v in overrides.items() if v is not None})
        return with_variable_named(cls, values, ENV_PREFIX)

    def replace(self, **changes) -> "SidecarConfig":
        return dataclasses.replace(self, **changes)


def with_variable_named(cls, values: dict, prefix: str):
    """cls(**values), its ConfigError naming the variable that sets the field, as a start-up
    error must ("max_queue: ..." reads "SLUICE_EMBED_MAX_QUEUE (max_queue): ...")."""
    try:
        return cls(**values)
    except ConfigError as exc:
        name, sep, rest = str(exc).partition(": ")
        if sep and name in {f.name for f in fields(cls)}:
            raise ConfigError(f"{prefix}{name.upper()} ({name}): {rest}") from None
        raise


def _convert(field: dataclasses.Field, raw: str):
    name = ENV_PREFIX + field.name.upper()
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    try:
        if kind == "bool":
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return lowered in ("1", "true", "yes")
        if kind == "float":
            return float(raw)
        if kind == "int":
            return int(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{name}: expected a {kind}, got {raw!r}") from None


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isascii() and port.isdigit() and 0 <= int(port) < 65536)


def _is_redis_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:                  # "Invalid IPv6 URL"
        return False
    if parts.scheme == "unix":
        return bool(parts.path)
    try:
        port = parts.port               # raises for a port that is no number or out of range
    except ValueError:
        return False
    return parts.scheme in ("redis", "rediss") and bool(parts.hostname) and port != 0


def redacted_url(url: str) -> str:
    """The URL as it may be logged: no user or password."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


def _finite_non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0
