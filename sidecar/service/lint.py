"""`sluice lint ENVOY_CONFIG...`: what will go wrong with Sluice behind this Envoy config, before
it is deployed.

Reads an Envoy bootstrap (YAML or JSON), or YAML with several documents: a Kubernetes ConfigMap
holding one, an Istio EnvoyFilter that patches Sluice into a gateway, an Envoy Gateway
EnvoyExtensionPolicy. One line per finding, naming the file and the path inside it; exit 1 when
there is a finding at or above --fail-on (default: warning), 0 otherwise; --json for CI.

The checks are what the sidecar relies on (envoy/envoy.yaml.tmpl says why for each setting):
the ext_proc filter and its processing modes, timeouts, failure mode, mode override, mutation
rules; the route re-resolved after the sidecar sets its cluster header; internal headers
stripped from clients before routing; per-route settings that load into the route settings
proto and pass the sidecar's own validation, with candidate clusters that exist.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
from typing import Iterable

import yaml

SEVERITIES = ("error", "warning")
EXT_PROC = "envoy.filters.http.ext_proc"
EXT_PROC_TYPE = "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "envoy.filters.http.router"
CLUSTER_HEADER = "x-sluice-cluster"
TIMEOUT_HEADER = "x-envoy-upstream-rq-timeout-ms"
INTERNAL_PREFIX = "x-sluice-"
ROUTE_ATTRIBUTES = ("xds.route_name", "xds.route_metadata")
# Below this the sidecar's slower steps (an embedding, a Redis round trip under load) time out
# and the request fails open or closed; envoy/envoy.yaml.tmpl uses 2 s.
MIN_MESSAGE_TIMEOUT_S = 1.0


@dataclasses.dataclass(frozen=True)
class Finding:
    file: str
    path: str
    severity: str       # error | warning
    code: str           # a short stable name, e.g. ext-proc-missing
    message: str

    def line(self) -> str:
        return f"{self.file}: {self.path or '.'}: {self.severity}[{self.code}]: {self.message}"


class _Linter:
    """Findings of one file; `path` arguments are dotted paths inside it."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.findings: list[Finding] = []
        self._seen: set[int] = set()      # YAML anchors share objects: each is checked once

    def add(self, path: str, severity: str, code: str, message: str) -> None:
        self.findings.append(Finding(self.file, path, severity, code, message))

    def once(self, obj) -> bool:
        if id(obj) in self._seen:
            return False
        self._seen.add(id(obj))
        return True

    # --- documents ------------------------------------------------------------------------

    def document(self, doc, where: str) -> bool:
        """Checks one YAML document; False when it holds nothing this linter knows."""
        if not isinstance(doc, dict):
            return False
        if "static_resources" in doc or "staticResources" in doc:
            self.bootstrap(doc, where)
            return True
        kind = doc.get("kind")
        if kind == "ConfigMap":
            found = False
            for key, text in (doc.get("data") or {}).items():
                try:
                    inner = yaml.safe_load(text) if isinstance(text, str) else None
                except yaml.YAMLError:
                    continue
                if isinstance(inner, dict) and ("static_resources" in inner or "staticResources" in inner):
                    self.bootstrap(inner, _join(where, f"data[{key!r}]"))
                    found = True
            return found
        if kind == "EnvoyFilter":
            self.envoy_filter(doc, where)
            return True
        if kind == "EnvoyExtensionPolicy":
            self.extension_policy(doc, where)
            return True
        return False

    def bootstrap(self, doc: dict, where: str) -> None:
        static = _get(doc, "static_resources") or {}
        clusters = None if _get(doc, "dynamic_resources") else {
            c.get("name") for c in _get(static, "clusters") or [] if isinstance(c, dict)}
        managers = sluiced = 0
        for li, listener in enumerate(_get(static, "listeners") or []):
            for ci, chain in enumerate(_get(listener, "filter_chains") or []):
                for fi, network_filter in enumerate(_get(chain, "filters") or []):
                    config = _get(network_filter, "typed_config") or {}
                    if network_filter.get("name") != HCM and _type(config) != HCM_TYPE:
                        continue
                    managers += 1
                    if not _for_sluice(config):
                        continue        # another listener (probes, metrics): not Sluice's
                    sluiced += 1
                    if self.once(config):
                        self.connection_manager(config, _join(
                            where, f"static_resources.listeners[{li}].filter_chains[{ci}].filters[{fi}].typed_config"),
                            clusters)
        if managers == 0:
            self.add(_join(where, "static_resources.listeners"), "error", "no-http-listener",
                     "no listener has an HTTP connection manager: nothing reaches Sluice")
        elif sluiced == 0:
            self.add(_join(where, "static_resources.listeners"), "error", "ext-proc-missing",
                     f"no HTTP connection manager has the {EXT_PROC} filter or routes with Sluice settings: "
                     "requests never reach Sluice")

    def connection_manager(self, hcm: dict, where: str, clusters: set | None) -> None:
        filters = _get(hcm, "http_filters") or []
        names = [f.get("name", "") if isinstance(f, dict) else "" for f in filters]
        found = [i for i, f in enumerate(filters) if _is_ext_proc(f)]
        if not found:
            self.add(_join(where, "http_filters"), "error", "ext-proc-missing",
                     f"no {EXT_PROC} filter: requests never reach Sluice")
        for i in found:
            if ROUTER in names and names.index(ROUTER) < i:
                self.add(_join(where, f"http_filters[{i}]"), "error", "ext-proc-after-router",
                         "the ext_proc filter comes after the router, which never passes a request on")
            self.ext_proc(_get(filters[i], "typed_config") or {}, _join(where, f"http_filters[{i}].typed_config"),
                          clusters)
        stripped = _stripped_headers(hcm)
        self.stripping(stripped, _join(where, "early_header_mutation_extensions"))
        fail_open = any(_get(_get(filters[i], "typed_config") or {}, "failure_mode_allow") is True for i in found)
        route_config = _get(hcm, "route_config")
        if route_config is None:
            return                      # RDS: the routes are checked where they are written
        sets_default = _sets_header(hcm, CLUSTER_HEADER)
        ext_proc_names = {filters[i].get("name") for i in found}
        for vi, host in enumerate(_get(route_config, "virtual_hosts") or []):
            for ri, route in enumerate(_get(host, "routes") or []):
                path = _join(where, f"route_config.virtual_hosts[{vi}].routes[{ri}]")
                fails_open = _fails_open([route, host, route_config], ext_proc_names, fail_open)
                self.route(route, path, clusters, stripped, fail_open and not sets_default, fails_open)

    def stripping(self, stripped: tuple[set, set], where: str) -> None:
        if not _covers(stripped, INTERNAL_PREFIX + "cluster"):
            self.add(where, "error", "internal-headers-not-stripped",
                     f"clients' {INTERNAL_PREFIX}* headers are not removed before routing: a client can "
                     f"choose its own cluster (remove_on_match key_matcher prefix {INTERNAL_PREFIX!r})")
        if not _covers(stripped, TIMEOUT_HEADER):
            self.add(where, "error", "internal-headers-not-stripped",
                     f"clients' {TIMEOUT_HEADER} is not removed before routing: a client sets its own "
                     f"upstream timeout where the sidecar sets none")

    def ext_proc(self, config: dict, where: str, clusters: set | None) -> None:
        mode = _get(config, "processing_mode") or {}
        wanted = {"request_header_mode": ("SEND",), "request_body_mode": ("BUFFERED",),
                  "response_header_mode": ("SEND",), "response_body_mode": ("NONE",)}
        envoy_default = {"request_header_mode": "SEND", "request_body_mode": "NONE",
                         "response_header_mode": "SEND", "response_body_mode": "NONE"}
        for name, values in wanted.items():
            value = _get(mode, name, envoy_default[name])
            if value not in values:
                self.add(_join(where, f"processing_mode.{name}"), "error", "processing-mode",
                         f"is {value}, the sidecar needs {' or '.join(values)}"
                         + (" (it reads the chat body to decide)" if name == "request_body_mode" else
                            " (it asks for response bodies per request through mode override)"
                            if name == "response_body_mode" else ""))
        if _get(config, "allow_mode_override") is not True:
            self.add(_join(where, "allow_mode_override"), "error", "mode-override",
                     "must be true: the sidecar skips unread response headers and captures cached "
                     "answers by overriding the processing mode per request")
        timeout = _seconds(_get(config, "message_timeout", "0.2s"))
        if timeout is None or timeout < MIN_MESSAGE_TIMEOUT_S:
            self.add(_join(where, "message_timeout"), "warning", "message-timeout",
                     f"is {_get(config, 'message_timeout', '0.2s (Envoy default)')}: below "
                     f"{MIN_MESSAGE_TIMEOUT_S:g}s an embedding or a Redis round trip under load times out "
                     "and the request skips Sluice (2s is the reference)")
        from sidecar.deadlines import EXTENDED_MESSAGE_TIMEOUT_S
        longest = _seconds(_get(config, "max_message_timeout", "0s"))
        if longest is None or longest < EXTENDED_MESSAGE_TIMEOUT_S:
            self.add(_join(where, "max_message_timeout"), "error", "max-message-timeout",
                     f"is {_get(config, 'max_message_timeout', 'unset')}: the sidecar extends a waiting "
                     f"request's message timeout to {EXTENDED_MESSAGE_TIMEOUT_S:g}s (admission queue, a twin's "
                     "answer); Envoy refuses a longer one and the request skips admission")
        if "failure_mode_allow" not in config and "failureModeAllow" not in config:
            self.add(_join(where, "failure_mode_allow"), "warning", "failure-mode",
                     "not set, so Envoy fails closed (a 500 for every request while the sidecar is down); "
                     "say which you want: true (fail open) or false")
        rules = _get(config, "mutation_rules") or {}
        if _get(rules, "allow_envoy") is not True:
            self.add(_join(where, "mutation_rules.allow_envoy"), "error", "mutation-rules",
                     f"must be true: ext_proc silently drops the sidecar's {TIMEOUT_HEADER} otherwise")
        if _get(rules, "disallow_all") is True:
            self.add(_join(where, "mutation_rules.disallow_all"), "error", "mutation-rules",
                     "drops every header the sidecar sets, its cluster header included")
        if _get(config, "route_cache_action") == "RETAIN" or _get(config, "disable_clear_route_cache") is True:
            key = "route_cache_action" if _get(config, "route_cache_action") == "RETAIN" else "disable_clear_route_cache"
            self.add(_join(where, key), "error", "route-cache",
                     f"the route is not re-resolved after the sidecar sets {CLUSTER_HEADER}: requests keep "
                     "the cluster chosen before it (or get 503 no_cluster)")
        attributes = _get(config, "request_attributes") or []
        for attribute in ROUTE_ATTRIBUTES:
            if attribute not in attributes:
                self.add(_join(where, "request_attributes"), "error", "request-attributes",
                         f"lacks {attribute!r}: the sidecar never sees the route's settings")
        service = _get(config, "grpc_service") or {}
        cluster = _get(_get(service, "envoy_grpc") or {}, "cluster_name")
        if cluster and clusters is not None and cluster not in clusters:
            self.add(_join(where, "grpc_service.envoy_grpc.cluster_name"), "error", "unknown-cluster",
                     f"no cluster named {cluster!r}{_suggest(cluster, clusters)}")

    def route(self, route: dict, where: str, clusters: set | None, stripped, no_default: bool,
              fails_open: bool) -> None:
        metadata = _get(_get(route, "metadata") or {}, "filter_metadata") or {}
        action = _get(route, "route") or {}
        if "sluice" not in metadata:
            return
        settings_path = _join(where, "metadata.filter_metadata.sluice")
        settings = self.route_settings(metadata["sluice"], settings_path, clusters, stripped)
        if settings is not None and settings.HasField("guard") and fails_open:
            self.add(_join(settings_path, "guard"), "error", "guard-fails-open",
                     "the route has a guard but fails open: whenever the sidecar is slow or down its prompts "
                     "reach the upstream unchecked, always where ext_proc is disabled for it (set "
                     "typed_per_filter_config for ext_proc on the route: ExtProcPerRoute "
                     "overrides.failure_mode_allow false, not disabled; docs/guard.md)")
        if settings is None or not settings.candidates:
            return
        if _get(action, "cluster_header") != CLUSTER_HEADER:
            self.add(_join(where, "route"), "error", "route-ignores-sidecar",
                     f"the route has Sluice candidates but does not route by cluster_header {CLUSTER_HEADER}: "
                     "the sidecar's choice is ignored")
        elif no_default:
            self.add(_join(where, "route.cluster_header"), "warning", "no-default-cluster",
                     f"nothing sets {CLUSTER_HEADER} before the sidecar: with failure_mode_allow, a request "
                     "that skips the sidecar gets 503 no_cluster (set a default in early_header_mutation)")
        if settings.scheduling.retry_other_cluster and clusters is not None:
            from sidecar.scheduling.retry import retry_clusters
            missing = [name for name in retry_clusters(settings.candidates) if name not in clusters]
            if missing:
                self.add(_join(settings_path, "scheduling.retry_other_cluster"), "error", "missing-retry-cluster",
                         f"retry_other_cluster needs a composite cluster (envoy.clusters.composite) per ordered "
                         f"pair of candidates; missing: {', '.join(missing)} (requests sent there get 503 no_cluster)")

    def route_settings(self, raw, where: str, clusters: set | None, stripped):
        """The settings as the sidecar loads them, or None after reporting why they do not load."""
        from google.protobuf import json_format

        from sidecar.route_settings import RouteSettings, RouteSettingsError, parse_route_settings
        if not isinstance(raw, dict):
            self.add(where, "error", "route-settings", "must be a mapping of route settings")
            return None
        unknown = list(_unknown_fields(raw, RouteSettings.DESCRIPTOR, where))
        for path, key, names in unknown:
            self.add(path, "error", "unknown-field", f"unknown field {key!r}{_suggest(key, names)}")
        if unknown:
            return None
        try:
            settings = parse_route_settings(raw)
        except (RouteSettingsError, json_format.ParseError) as exc:
            self.add(where, "error", "route-settings", _short(str(exc)))
            return None
        for check in route_checks():
            try:
                check(settings)
            except ValueError as exc:
                self.add(where, "error", "route-settings", str(exc))
        for i, candidate in enumerate(settings.candidates):
            if clusters is not None and candidate.cluster not in clusters:
                self.add(_join(where, f"candidates[{i}].cluster"), "error", "unknown-cluster",
                         f"no cluster named {candidate.cluster!r} in this config{_suggest(candidate.cluster, clusters)}")
        roles = [c.role or "primary" for c in settings.candidates]
        if roles and "primary" not in roles:
            self.add(_join(where, "candidates"), "error", "fallback-without-primary",
                     "every candidate is a fallback: the route has no cluster to prefer")
        if settings.admission.enabled and not settings.admission.HasField("default_deadline_s"):
            self.add(_join(where, "admission"), "warning", "admission-deadline",
                     "admission is on with no deadline source: requests without x-request-deadline-ms wait "
                     "up to the built-in 60 s; set admission.default_deadline_s")
        self._semantic_threshold(settings, where)
        for field, what in (("priority_header", "priority"), ("tenant_header", "tenant")):
            section = settings.admission if field == "priority_header" else settings.cache
            header = getattr(section, field).lower()
            if header and not _covers(stripped, header):
                self.add(_join(where, f"{'admission' if field == 'priority_header' else 'cache'}.{field}"),
                         "error", "internal-headers-not-stripped",
                         f"{header!r} is not removed from clients before routing: a client can choose its own {what}")
        return settings

    def _semantic_threshold(self, settings, where: str) -> None:
        from sidecar.pipeline.cache_stage import cache_policy, semantic_threshold_unread
        try:
            policy = cache_policy(settings)
        except ValueError:
            return      # reported by route_checks
        if semantic_threshold_unread(settings, policy):
            self.add(_join(where, "cache.semantic_threshold"), "warning", "semantic-threshold-unread",
                     "semantic_threshold is read only by the lexical decision (max_false_hit_rate: 0); "
                     f"this route's semantic hits are decided by the verifier at max_false_hit_rate "
                     f"{policy.max_false_hit_rate:g}: set max_false_hit_rate, or 0 to keep the threshold")

    # --- Istio and Envoy Gateway ----------------------------------------------------------

    def envoy_filter(self, doc: dict, where: str) -> None:
        patches = (doc.get("spec") or {}).get("configPatches") or []
        clusters: set = set()
        ext_procs, managers, route_patches, ext_proc_names = [], [], [], set()
        for i, patch in enumerate(patches):
            value = ((patch or {}).get("patch") or {}).get("value") or {}
            path = _join(where, f"spec.configPatches[{i}].patch.value")
            applies = patch.get("applyTo")
            if applies == "CLUSTER" and value.get("name"):
                clusters.add(value["name"])
            elif applies == "HTTP_FILTER" and _is_ext_proc(value):
                ext_procs.append((value.get("typed_config") or {}, _join(path, "typed_config")))
                ext_proc_names.add(value.get("name") or EXT_PROC)
            elif applies == "NETWORK_FILTER" and (value.get("name") == HCM or _type(value.get("typed_config")) == HCM_TYPE):
                managers.append(value.get("typed_config") or {})
            elif applies in ("HTTP_ROUTE", "VIRTUAL_HOST", "ROUTE_CONFIGURATION"):
                # Each route with the scopes above it in the patch (its per-filter configs' order).
                routes = [(value, path, [value])] if applies == "HTTP_ROUTE" else []
                above = [value] if applies == "ROUTE_CONFIGURATION" else []
                for vi, host in enumerate(value.get("virtual_hosts") or ([value] if applies == "VIRTUAL_HOST" else [])):
                    routes += [(r, _join(path, f"virtual_hosts[{vi}].routes[{ri}]") if applies != "VIRTUAL_HOST"
                                else _join(path, f"routes[{ri}]"), [r, host] + above) for ri, r in enumerate(host.get("routes") or [])]
                stripped = _union(_stripped_headers(m) for m in managers)
                route_patches += [(route, route_path, scopes, stripped) for route, route_path, scopes in routes]
        fail_open = any(_get(config, "failure_mode_allow") is True for config, _ in ext_procs)
        ext_proc_names = ext_proc_names or {EXT_PROC}      # per-route configs' key: the filter's name in its patch
        for route, route_path, scopes, stripped in route_patches:
            self.route(route, route_path, None, stripped, False, _fails_open(scopes, ext_proc_names, fail_open))
        if not ext_procs:
            self.add(_join(where, "spec.configPatches"), "error", "ext-proc-missing",
                     f"no HTTP_FILTER patch adds {EXT_PROC}: requests never reach Sluice")
        for config, path in ext_procs:
            self.ext_proc(config, path, clusters if clusters else None)
        self.stripping(_union(_stripped_headers(m) for m in managers), _join(where, "spec.configPatches"))

    def extension_policy(self, doc: dict, where: str) -> None:
        processors = (doc.get("spec") or {}).get("extProc") or []
        if not processors:
            self.add(_join(where, "spec.extProc"), "error", "ext-proc-missing", "no extProc: requests never reach Sluice")
        for i, processor in enumerate(processors):
            path = _join(where, f"spec.extProc[{i}]")
            mode = processor.get("processingMode") or {}
            request = mode.get("request")
            if request is None or (request or {}).get("body") != "Buffered":
                self.add(_join(path, "processingMode.request.body"), "error", "processing-mode",
                         "must be Buffered: the sidecar reads the chat body to decide")
            if "response" not in mode:
                self.add(_join(path, "processingMode.response"), "error", "processing-mode",
                         "must be set ({} sends response headers): the sidecar learns from each answer")
            if mode.get("allowModeOverride") is not True:
                self.add(_join(path, "processingMode.allowModeOverride"), "error", "mode-override",
                         "must be true: the sidecar overrides the processing mode per request")
            attributes = (request or {}).get("attributes") or []
            for attribute in ROUTE_ATTRIBUTES:
                if attribute not in attributes:
                    self.add(_join(path, "processingMode.request.attributes"), "error", "request-attributes",
                             f"lacks {attribute!r}: the sidecar never sees the route's settings")
            timeout = _seconds(processor.get("messageTimeout", "0.2s"))
            if timeout is None or timeout < MIN_MESSAGE_TIMEOUT_S:
                self.add(_join(path, "messageTimeout"), "warning", "message-timeout",
                         f"is {processor.get('messageTimeout', '200ms (the default)')}: below "
                         f"{MIN_MESSAGE_TIMEOUT_S:g}s slower steps time out and the request skips Sluice")
            if "failOpen" not in processor:
                self.add(_join(path, "failOpen"), "warning", "failure-mode",
                         "not set, so Envoy fails closed while the sidecar is down; say which you want")


def route_checks():
    """The sidecar's own validation of a route's settings, each raising ValueError naming the
    field: what the routing, cache and admission stages build from them at the first request."""
    from sidecar.pipeline.admission_stage import route_admission
    from sidecar.pipeline.cache_stage import cache_policy
    from sidecar.pipeline.route_config import build_route_config
    return (lambda s: build_route_config(s, "lint"), route_admission, cache_policy)


def _unknown_fields(raw: dict, descriptor, where: str):
    """(path, key, known names) of each key no field of `descriptor` has, recursively."""
    names = {}
    for field in descriptor.fields:
        names[field.name] = names[field.json_name] = field
    for key, value in raw.items():
        field = names.get(key)
        if field is None:
            yield _join(where, str(key)), str(key), sorted({f.name for f in descriptor.fields})
            continue
        message = field.message_type
        if message is None or message.GetOptions().map_entry:
            continue
        if _repeated(field) and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    yield from _unknown_fields(item, message, _join(where, f"{key}[{i}]"))
        elif isinstance(value, dict):
            yield from _unknown_fields(value, message, _join(where, str(key)))


def _routes(hcm: dict):
    for host in _get(_get(hcm, "route_config") or {}, "virtual_hosts") or []:
        yield from (r for r in _get(host, "routes") or [] if isinstance(r, dict))


def _for_sluice(hcm: dict) -> bool:
    """Whether a connection manager is meant to pass requests to Sluice: it has the ext_proc
    filter, or a route with Sluice settings or routing by the sidecar's header."""
    if any(_is_ext_proc(f) for f in _get(hcm, "http_filters") or []):
        return True
    return any("sluice" in (_get(_get(r, "metadata") or {}, "filter_metadata") or {})
               or _get(_get(r, "route") or {}, "cluster_header") == CLUSTER_HEADER for r in _routes(hcm))


def _repeated(field) -> bool:
    is_repeated = getattr(field, "is_repeated", None)     # protobuf >= 6; `label` before
    return bool(is_repeated) if is_repeated is not None else field.label == field.LABEL_REPEATED


def _stripped_headers(hcm: dict) -> tuple[set, set]:
    """(prefixes, exact names) the connection manager removes before routing."""
    prefixes, exact = set(), set()
    for extension in _get(hcm, "early_header_mutation_extensions") or []:
        for mutation in _get(_get(extension, "typed_config") or {}, "mutations") or []:
            matcher = _get(_get(mutation, "remove_on_match") or {}, "key_matcher") or {}
            if "prefix" in matcher:
                prefixes.add(str(matcher["prefix"]).lower())
            if "exact" in matcher:
                exact.add(str(matcher["exact"]).lower())
            if "remove" in mutation:
                exact.add(str(mutation["remove"]).lower())
    return prefixes, exact


def _sets_header(hcm: dict, header: str) -> bool:
    for extension in _get(hcm, "early_header_mutation_extensions") or []:
        for mutation in _get(_get(extension, "typed_config") or {}, "mutations") or []:
            if str(((_get(mutation, "append") or {}).get("header") or {}).get("key", "")).lower() == header:
                return True
    return False


def _covers(stripped: tuple[set, set], header: str) -> bool:
    prefixes, exact = stripped
    return header in exact or any(header.startswith(p) for p in prefixes)


def _union(parts: Iterable[tuple[set, set]]) -> tuple[set, set]:
    prefixes, exact = set(), set()
    for p, e in parts:
        prefixes |= p
        exact |= e
    return prefixes, exact


def _is_ext_proc(http_filter) -> bool:
    return isinstance(http_filter, dict) and (
        http_filter.get("name") == EXT_PROC or _type(http_filter.get("typed_config")) == EXT_PROC_TYPE)


def _fails_open(scopes: list, ext_proc_names: set, filter_allows: bool) -> bool:
    """Whether the ext_proc filter lets a route's requests through unchecked, reading the
    typed_per_filter_config of `scopes` (the route, its virtual host, its route configuration:
    most specific first) as Envoy does: the most specific scope that configures the filter
    decides whether it is disabled (a FilterConfig's `disabled`, or ExtProcPerRoute's: the filter
    never runs there), and the most specific ExtProcPerRoute that sets overrides.failure_mode_allow
    overrides the filter's own (`filter_allows`)."""
    disabled = allows = None
    for scope in scopes:
        per_filter = _get(scope, "typed_per_filter_config") or {}
        for name in ext_proc_names:
            config = per_filter.get(name) if isinstance(per_filter, dict) else None
            if not isinstance(config, dict):
                continue
            if _type(config) == "envoy.config.route.v3.FilterConfig":
                if _get(config, "disabled") is True:
                    disabled = True if disabled is None else disabled
                    continue                # its config is ignored
                config = _get(config, "config")
                if not isinstance(config, dict):
                    continue
            if disabled is None:
                disabled = _get(config, "disabled") is True
            allow = _get(_get(config, "overrides"), "failure_mode_allow")
            if allows is None and isinstance(allow, bool):
                allows = allow
    return bool(disabled) or (filter_allows if allows is None else allows)


def _type(config) -> str:
    return str(config.get("@type", "")).rsplit("/", 1)[-1] if isinstance(config, dict) else ""


def _get(mapping, key: str, default=None):
    """A field by its proto name or its lowerCamelCase JSON name (Envoy accepts both)."""
    if not isinstance(mapping, dict):
        return default
    if key in mapping:
        return mapping[key]
    camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
    return mapping.get(camel, default)


def _seconds(value) -> float | None:
    """A google.protobuf.Duration as Envoy's YAML writes it ("2s", "0.25s", {seconds, nanos})."""
    if isinstance(value, dict):
        return float(value.get("seconds", 0)) + float(value.get("nanos", 0)) / 1e9
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)(ms|s)\s*", str(value))
    if match is None:
        return None
    number = float(match.group(1))
    return number / 1000 if match.group(2) == "ms" else number


def _suggest(name: str, names) -> str:
    close = difflib.get_close_matches(name, sorted(n for n in names if n), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _short(message: str) -> str:
    return message.replace("route metadata 'sluice': ", "")


def _join(where: str, part: str) -> str:
    if not where:
        return part
    return where + part if part.startswith("[") else f"{where}.{part}"


def lint_text(text: str, file: str = "<stdin>") -> list[Finding]:
    linter = _Linter(file)
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        linter.add("", "error", "yaml", f"not valid YAML: {_short(str(exc)).splitlines()[0]}")
        return linter.findings
    known = False
    for i, doc in enumerate(docs):
        where = f"[{i}]" if len(docs) > 1 else ""
        try:
            known |= linter.document(doc, where)
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            # A value of the wrong shape where a mapping or list belongs: said, not a crash.
            linter.add(where, "error", "malformed", f"cannot read this document: {type(exc).__name__}: {exc}")
            known = True
    if not known:
        linter.add("", "error", "no-envoy-config",
                   "no Envoy bootstrap, ConfigMap holding one, EnvoyFilter or EnvoyExtensionPolicy found")
    return linter.findings


def lint_file(path: str) -> list[Finding]:
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        return [Finding(path, "", "error", "unreadable", str(exc))]
    return lint_text(text, path)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    lint = subparsers.add_parser("lint", help="check an Envoy config (or ConfigMap, EnvoyFilter, "
                                 "EnvoyExtensionPolicy) for what Sluice needs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    lint.add_argument("files", nargs="+", metavar="ENVOY_CONFIG", help="YAML or JSON files; - reads stdin")
    lint.add_argument("--json", action="store_true", help="print the findings as one JSON array")
    lint.add_argument("--fail-on", choices=SEVERITIES, default="warning",
                      help="lowest severity that makes the exit status 1 (default: warning)")
    lint.set_defaults(func=run_lint)


def run_lint(args: argparse.Namespace) -> int:
    findings = [f for path in args.files for f in lint_file(path)]
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for finding in findings:
            print(finding.line())
        # A summary on stderr: a person sees that the check ran, scripts keep one finding per line.
        counts = ", ".join(f"{sum(f.severity == s for f in findings)} {s}" for s in SEVERITIES)
        print(f"{len(args.files)} file(s) checked: {counts}" if findings
              else f"{len(args.files)} file(s) checked: everything Sluice needs is there", file=sys.stderr)
    failing = SEVERITIES[:SEVERITIES.index(args.fail_on) + 1]
    return 1 if any(f.severity in failing for f in findings) else 0
