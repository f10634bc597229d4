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
