"""Per-route settings: from Envoy's route metadata (namespace "sluice") to a typed message.

Envoy 1.40 sends the `xds.route_metadata` attribute as the text format of
`envoy.config.core.v3.Metadata`; we parse that, take filter_metadata["sluice"] and load it into
`sluice.v1.RouteSettings` (proto/sluice/v1/route_settings.proto), so unknown or mistyped fields
are reported by name. Parsed results are cached: a route's metadata is the same on every request.
"""
from __future__ import annotations

import functools
import logging

from envoy.config.core.v3 import base_pb2
from google.protobuf import json_format, text_format

from sidecar.protos import route_settings_pb2

NAMESPACE = "sluice"
log = logging.getLogger("sluice.route_settings")

RouteSettings = route_settings_pb2.RouteSettings


INTERNAL_HEADER_PREFIX = "x-sluice-"     # envoy/envoy.yaml.tmpl strips these from clients


def warn_unless_internal(route_name: str, header: str, what: str) -> None:
    """Warn when a route trusts a header naming `what` that the reference Envoy config lets
    clients send: only Envoy, from a verified identity, may set such a header."""
    if header and not header.startswith(INTERNAL_HEADER_PREFIX):
        log.warning("route %s takes the %s from %s, which the reference Envoy config does not strip "
                    "from clients (it strips %s*): unless your Envoy removes clients' copies before "
                    "the sidecar, a client can choose its %s", route_name, what, header,
                    INTERNAL_HEADER_PREFIX, what)


class RouteSettingsError(ValueError):
    """The route's sluice metadata is invalid; the message names the field."""


def parse_route_settings(metadata: dict | None) -> RouteSettings:
    """Validate filter_metadata["sluice"] (already a plain dict). Raises RouteSettingsError."""
    settings = RouteSettings()
    if not metadata:
        return settings
    try:
        json_format.ParseDict(metadata, settings)
    except json_format.ParseError as exc:
        raise RouteSettingsError(f"route metadata '{NAMESPACE}': {exc}") from None
    for index, candidate in enumerate(settings.candidates):
        where = f"{NAMESPACE}.candidates[{index}]"
        if not candidate.cluster:
            raise RouteSettingsError(f"{where}.cluster must be a non-empty cluster name")
        if candidate.HasField("weight") and not candidate.weight >= 0:
            raise RouteSettingsError(f"{where}.weight must be >= 0, got {candidate.weight}")
    return settings


@functools.lru_cache(maxsize=256)
def metadata_from_attribute(text: str) -> dict | None:
    """filter_metadata["sluice"] from the text-format Metadata Envoy sends (None when absent)."""
    metadata = base_pb2.Metadata()
    text_format.Parse(text, metadata)
    if NAMESPACE not in metadata.filter_metadata:
        return None
    return json_format.MessageToDict(metadata.filter_metadata[NAMESPACE])


@functools.lru_cache(maxsize=256)
def settings_from_attribute(text: str) -> RouteSettings | RouteSettingsError:
    """Cached parse of one route's metadata; an error is returned (and cached), not raised."""
    try:
        return parse_route_settings(metadata_from_attribute(text))
    except (RouteSettingsError, text_format.ParseError) as exc:
        error = exc if isinstance(exc, RouteSettingsError) else RouteSettingsError(str(exc))
        log.error("invalid route settings, using the route's default cluster: %s", error)
        return error


class PerSettings:
    """Values derived from route settings, memoised per settings object (and extra key parts).

    settings_from_attribute hands every request of a route the same object, so this is a dict
    hit where keying by content would serialise the message on every request (~10 µs each
    time). An entry holds its object, so the id it is keyed by cannot be reused while it lives.
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self._max_entries = max_entries
        self._entries: dict[tuple, tuple[RouteSettings, object]] = {}

    def get(self, settings: RouteSettings, derive, *extra):
        key = (id(settings), *extra)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is settings:
            return entry[1]
        value = derive(settings, *extra)
        if len(self._entries) >= self._max_entries:    # bounded: route configs are few
            self._entries.clear()
        self._entries[key] = (settings, value)
        return value
