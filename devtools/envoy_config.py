"""Render envoy/envoy.yaml.tmpl into a runnable Envoy config (for `make run`, tests and benchmarks)."""
from __future__ import annotations

import pathlib
import string
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "envoy" / "envoy.yaml.tmpl"

DEFAULTS: dict[str, Any] = {
    "ADMIN_PORT": 9901,
    "HTTP_PORT": 10000,
    "HTTPS_PORT": 10443,
    "SIDECAR_PORT": 50051,
    "UPSTREAM_A_PORT": 8001,
    "UPSTREAM_B_PORT": 8002,
    "DEFAULT_CLUSTER": "upstream_a",
    "TLS_CERT": str(ROOT / "build" / "tls" / "cert.pem"),
    "TLS_KEY": str(ROOT / "build" / "tls" / "key.pem"),
    "FAILURE_MODE_ALLOW": "true",
    "MESSAGE_TIMEOUT": "2s",
    "MAX_MESSAGE_TIMEOUT": "60s",
    "ROUTE_TIMEOUT": "300s",
    "RATE_LIMIT_TOKENS": 1000,
    "RATE_LIMIT_FILL_INTERVAL": "1s",
    "MAX_BODY_BYTES": 1048576,
    "MAX_CONNECTIONS": 10000,
    "HEALTH_CHECK_INTERVAL": "0.5s",
    "HEALTH_CHECK_TIMEOUT": "0.5s",
    "SIDECAR_RETRY_AFTER_S": 1,
    "REQUEST_HEADERS_TIMEOUT": "10s",
    "REQUEST_TIMEOUT": "90s",
    "STREAM_IDLE_TIMEOUT": "300s",
    "FIRST_BYTE_MS": 60000,
    "MAX_RETRIES": 1024,
}


def render_text(**overrides: Any) -> str:
    """The template with every ${NAME} filled; unknown names raise KeyError."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise KeyError(f"unknown Envoy template variables: {sorted(unknown)}")
    values = {**DEFAULTS, **overrides}
    return string.Template(TEMPLATE.read_text()).substitute({k: str(v) for k, v in values.items()})


def render(**overrides: Any) -> dict:
    """The rendered config as a dict, for callers that adjust routes before writing it."""
    return yaml.safe_load(render_text(**overrides))


def http_connection_manager(config: dict) -> dict:
    """The HCM typed_config shared by the listeners (after YAML anchors are expanded, each
    listener holds its own copy: `routes()` updates all of them)."""
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def http_connection_managers(config: dict) -> list[dict]:
    """Every listener's HCM typed_config (the YAML anchor's copies), for changes to all of them."""
    return [listener["filter_chains"][0]["filters"][0]["typed_config"]
            for listener in config["static_resources"]["listeners"]]


def chat_route(name: str, prefix: str, candidates: list[dict] | None, rewrite: str | None = None,
               scheduling: dict | None = None) -> dict:
    """An Envoy route steered by the sidecar (cluster_header), with Sluice settings in its metadata."""
    route = {"cluster_header": "x-sluice-cluster", "timeout": "60s"}
    if rewrite is not None:
        route["prefix_rewrite"] = rewrite
    sluice = {"name": name}
    if candidates is not None:
        sluice["candidates"] = candidates
    if scheduling is not None:
        sluice["scheduling"] = scheduling
    return {"name": name, "match": {"prefix": prefix}, "route": route,
            "metadata": {"filter_metadata": {"sluice": sluice}}}


def fail_closed(route: dict) -> dict:
    """The route fails closed whatever the ext_proc filter says: a guarded route's prompts never
    reach the upstream unchecked when the sidecar is slow or down (docs/guard.md)."""
    route.setdefault("typed_per_filter_config", {})["envoy.filters.http.ext_proc"] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"failure_mode_allow": False}}
    return route


def set_routes(config: dict, routes: list[dict]) -> None:
    """Replace the routes of every listener (tests add per-route settings this way)."""
    for hcm in http_connection_managers(config):
        hcm["route_config"]["virtual_hosts"][0]["routes"] = routes


def add_cluster(config: dict, name: str, port: int) -> None:
    """Another loopback upstream cluster, shaped like the template's upstream_b."""
    import copy
    clusters = config["static_resources"]["clusters"]
    cluster = copy.deepcopy(next(c for c in clusters if c["name"] == "upstream_b"))
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = name
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"]["port_value"] = port
    clusters.append(cluster)


def add_endpoint(config: dict, cluster_name: str, port: int) -> None:
    """Another loopback endpoint of a cluster (e.g. a second sidecar replica)."""
    import copy
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == cluster_name)
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    extra = copy.deepcopy(endpoints[0])
    extra["endpoint"]["address"]["socket_address"]["port_value"] = port
    endpoints.append(extra)


def write(config: dict, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
