"""`sluice lint`: every config the repository ships is clean, and each finding fires on a small
bad config (the reference config with one thing broken), naming the path."""
import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from devtools import envoy_config
from devtools.stack import BIN, ROOT
from sidecar.service.lint import lint_text

HCM = "static_resources.listeners[0].filter_chains[0].filters[0].typed_config"
EXT_PROC = HCM + ".http_filters[1].typed_config"
ROUTE = HCM + ".route_config.virtual_hosts[0].routes[0]"
SETTINGS = ROUTE + ".metadata.filter_metadata.sluice"


def shipped_configs() -> list[tuple[str, str]]:
    found = [("envoy/envoy.yaml.tmpl (rendered)", envoy_config.render_text()),
             ("envoy/envoy.yaml.tmpl (rendered, fail closed)", envoy_config.render_text(FAILURE_MODE_ALLOW="false")),
             ("docs/snippets/byo-envoy.yaml", (ROOT / "docs/snippets/byo-envoy.yaml").read_text())]
    for path in sorted([*(ROOT / "k8s").rglob("*.yaml"), *(ROOT / "deploy").rglob("*.yaml")]):
        found.append((str(path.relative_to(ROOT)), path.read_text()))
    return found


def test_every_shipped_config_is_clean():
    checked = []
    for name, text in shipped_configs():
        findings = [f for f in lint_text(text, name) if f.code != "no-envoy-config"]
        assert findings == [], "\n".join(f.line() for f in findings)
        if not any(f.code == "no-envoy-config" for f in lint_text(text, name)):
            checked.append(name)
    # Not vacuous: the gateway config, the Istio and Envoy Gateway integrations were read.
    assert {"k8s/base/envoy.yaml", "k8s/integrations/istio/envoyfilter.yaml",
            "k8s/integrations/envoy-gateway/envoyextensionpolicy.yaml"} <= set(checked), checked


def test_configmap_and_multi_document_yaml():
    envoy = (ROOT / "k8s/base/envoy.yaml").read_text()
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "sluice-envoy"},
                 "data": {"envoy.yaml": envoy.replace("allow_envoy: true", "allow_envoy: false")}}
    text = yaml.safe_dump({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}}) + "---\n" + yaml.safe_dump(configmap)
    findings = lint_text(text, "cm.yaml")
    assert [(f.code, f.path) for f in findings] == [
        ("mutation-rules", "[1].data['envoy.yaml']." + EXT_PROC + ".mutation_rules.allow_envoy")]


def reference() -> dict:
    return yaml.safe_load(envoy_config.render_text())


def _hcm(c):
    return c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _ext(c):
    return _hcm(c)["http_filters"][1]["typed_config"]


def _route(c):
    return _hcm(c)["route_config"]["virtual_hosts"][0]["routes"][0]


def _sluice(c):
    return _route(c)["metadata"]["filter_metadata"]["sluice"]


def _set(getter, key, value):
    def mutate(c):
        if value is None:
            getter(c).pop(key)
        else:
            getter(c)[key] = value
    return mutate


CASES = [
    ("no ext_proc", lambda c: _hcm(c)["http_filters"].pop(1), "ext-proc-missing", HCM + ".http_filters"),
    ("after router", lambda c: _hcm(c)["http_filters"].append(_hcm(c)["http_filters"].pop(1)),
     "ext-proc-after-router", HCM + ".http_filters[2]"),
    ("body not buffered", lambda c: _ext(c)["processing_mode"].update(request_body_mode="NONE"),
     "processing-mode", EXT_PROC + ".processing_mode.request_body_mode"),
    ("header SKIP", lambda c: _ext(c)["processing_mode"].update(request_header_mode="SKIP"),
     "processing-mode", EXT_PROC + ".processing_mode.request_header_mode"),
    ("no mode override", _set(_ext, "allow_mode_override", None), "mode-override", EXT_PROC + ".allow_mode_override"),
    ("default message timeout", _set(_ext, "message_timeout", None), "message-timeout", EXT_PROC + ".message_timeout"),
    ("short message timeout", _set(_ext, "message_timeout", "0.3s"), "message-timeout", EXT_PROC + ".message_timeout"),
    ("no max message timeout", _set(_ext, "max_message_timeout", None), "max-message-timeout",
     EXT_PROC + ".max_message_timeout"),
    ("short max message timeout", _set(_ext, "max_message_timeout", "10s"), "max-message-timeout",
     EXT_PROC + ".max_message_timeout"),
    ("implicit failure mode", _set(_ext, "failure_mode_allow", None), "failure-mode", EXT_PROC + ".failure_mode_allow"),
    ("envoy mutations dropped", _set(_ext, "mutation_rules", {}), "mutation-rules",
     EXT_PROC + ".mutation_rules.allow_envoy"),
    ("route cache retained", _set(_ext, "route_cache_action", "RETAIN"), "route-cache", EXT_PROC + ".route_cache_action"),
    ("route cache never cleared", _set(_ext, "disable_clear_route_cache", True), "route-cache",
     EXT_PROC + ".disable_clear_route_cache"),
    ("no route metadata", _set(_ext, "request_attributes", ["xds.route_name"]), "request-attributes",
     EXT_PROC + ".request_attributes"),
    ("sidecar cluster unknown", lambda c: _ext(c)["grpc_service"]["envoy_grpc"].update(cluster_name="sluice_sidcar"),
     "unknown-cluster", EXT_PROC + ".grpc_service.envoy_grpc.cluster_name"),
    ("headers not stripped", _set(_hcm, "early_header_mutation_extensions", None), "internal-headers-not-stripped",
     HCM + ".early_header_mutation_extensions"),
    ("fixed cluster", lambda c: _hcm(c)["route_config"]["virtual_hosts"][0]["routes"][0].update(
        route={"cluster": "upstream_a"}), "route-ignores-sidecar", ROUTE + ".route"),
    ("unknown field", lambda c: _sluice(c).update(candidate=_sluice(c).pop("candidates")), "unknown-field",
     SETTINGS + ".candidate"),
    ("unknown nested field", lambda c: _sluice(c).update(cache={"semantic_treshold": 0.9}), "unknown-field",
     SETTINGS + ".cache.semantic_treshold"),
    ("wrong type", lambda c: _sluice(c)["candidates"][0].update(weight="heavy"), "route-settings", SETTINGS),
    ("out of range", lambda c: _sluice(c).update(cache={"semanticThreshold": 1.5}), "route-settings", SETTINGS),
    ("negative weight", lambda c: _sluice(c)["candidates"][0].update(weight=-1), "route-settings", SETTINGS),
    ("unknown candidate", lambda c: _sluice(c)["candidates"][0].update(cluster="upstream_c"), "unknown-cluster",
     SETTINGS + ".candidates[0].cluster"),
    ("fallback only", lambda c: [x.update(role="fallback") for x in _sluice(c)["candidates"]],
     "fallback-without-primary", SETTINGS + ".candidates"),
    ("admission without deadline", lambda c: _sluice(c).update(admission={"enabled": True}), "admission-deadline",
     SETTINGS + ".admission"),
    ("priority header not stripped", lambda c: _sluice(c).update(
        admission={"enabled": True, "default_deadline_s": 30, "priority_header": "x-priority"}),
     "internal-headers-not-stripped", SETTINGS + ".admission.priority_header"),
    ("semantic threshold the verifier does not read", lambda c: _sluice(c).update(cache={"semantic_threshold": 0.95}),
     "semantic-threshold-unread", SETTINGS + ".cache.semantic_threshold"),
    ("retry cluster missing", lambda c: c["static_resources"]["clusters"].pop(),
     "missing-retry-cluster", SETTINGS + ".scheduling.retry_other_cluster"),
    ("guard failing open", lambda c: _sluice(c).update(guard={"words": [{"name": "w", "words": ["x"]}]}),
     "guard-fails-open", SETTINGS + ".guard"),
    ("no default cluster", lambda c: _hcm(c)["early_header_mutation_extensions"][0]["typed_config"]["mutations"].pop(2),
     "no-default-cluster", ROUTE + ".route.cluster_header"),
]


@pytest.mark.parametrize("name,mutate,code,path", CASES, ids=[c[0] for c in CASES])
def test_each_finding_on_a_small_bad_config(name, mutate, code, path):
    config = reference()
    mutate(config)
    findings = lint_text(yaml.safe_dump(config), "bad.yaml")
    assert (code, path) in [(f.code, f.path) for f in findings], "\n".join(f.line() for f in findings)
    # The reference itself has none: the finding is the mutation's.
    assert lint_text(yaml.safe_dump(reference()), "good.yaml") == []


def test_closest_field_is_suggested():
    config = reference()
    _sluice(config)["schedulng"] = {}
    [finding] = lint_text(yaml.safe_dump(config), "bad.yaml")
    assert "did you mean 'scheduling'" in finding.message


def test_istio_envoy_filter_findings():
    doc = yaml.safe_load((ROOT / "k8s/integrations/istio/envoyfilter.yaml").read_text())
    patches = doc["spec"]["configPatches"]
    ext = next(p for p in patches if p["applyTo"] == "HTTP_FILTER")["patch"]["value"]["typed_config"]
    ext["processing_mode"]["request_body_mode"] = "STREAMED"
    ext["grpc_service"]["envoy_grpc"]["cluster_name"] = "sluice_extproc"
    patches[:] = [p for p in patches if p["applyTo"] != "NETWORK_FILTER"]
    codes = {(f.code, f.path.rsplit(".", 2)[-1]) for f in lint_text(yaml.safe_dump(doc), "ef.yaml")}
    assert ("processing-mode", "request_body_mode") in codes
    assert ("unknown-cluster", "cluster_name") in codes
    assert ("internal-headers-not-stripped", "configPatches") in codes


def test_envoy_gateway_policy_findings():
    doc = yaml.safe_load((ROOT / "k8s/integrations/envoy-gateway/envoyextensionpolicy.yaml").read_text())
    processor = doc["spec"]["extProc"][0]
    processor["processingMode"]["request"].pop("body")
    processor.pop("failOpen")
    codes = sorted(f.code for f in lint_text(yaml.safe_dump(doc), "eg.yaml"))
    assert codes == ["failure-mode", "processing-mode"]


@pytest.mark.parametrize("text,code", [
    ("{not: [valid", "yaml"), ("just a string", "no-envoy-config"), ("kind: Service\n", "no-envoy-config"),
    ("static_resources: {listeners: []}", "no-http-listener"),
    ("static_resources: {listeners: [{filter_chains: 3}]}", "malformed"),
])
def test_input_that_is_no_config_is_said_not_crashed_on(text, code):
    assert [f.code for f in lint_text(text, "x.yaml")] == [code]


def test_cli_exit_status_and_json(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(envoy_config.render_text())
    config = reference()
    _set(_ext, "failure_mode_allow", None)(config)
    bad.write_text(yaml.safe_dump(config))

    def lint(*args):
        return subprocess.run([str(BIN / "sluice"), "lint", *args], capture_output=True, text=True, timeout=120)

    result = lint(str(good))
    assert result.returncode == 0 and result.stdout == ""
    assert "everything Sluice needs is there" in result.stderr
    result = lint(str(bad))
    assert result.returncode == 1 and "1 warning" in result.stderr
    assert result.stdout.strip() == f"{bad}: {EXT_PROC}.failure_mode_allow: warning[failure-mode]: " + \
        "not set, so Envoy fails closed (a 500 for every request while the sidecar is down); say which you want: " \
        "true (fail open) or false"
    assert lint("--fail-on", "error", str(bad)).returncode == 0
    result = lint("--json", str(good), str(bad))
    assert result.returncode == 1
    assert [(f["file"], f["code"]) for f in json.loads(result.stdout)] == [(str(bad), "failure-mode")]


def test_copy_of_reference_unchanged():
    # The cases mutate fresh copies: the reference the tests compare with stays as shipped.
    assert reference() == copy.deepcopy(reference())
    assert Path(ROOT / "envoy/envoy.yaml.tmpl").exists()


@pytest.mark.parametrize("page", ["docs/routes.md", "README.md"])
def test_route_settings_examples_in_the_docs_are_clean(page):
    """The route settings shown to readers load into the proto and pass the sidecar's checks."""
    text = (ROOT / page).read_text()
    examples = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    example = next(e for e in examples if _find_sluice(e) is not None)
    settings = _find_sluice(example)
    assert settings["candidates"]
    config = reference()
    _route(config)["metadata"]["filter_metadata"]["sluice"] = settings
    if isinstance(example, dict) and "typed_per_filter_config" in example:       # shown beside the metadata
        _route(config)["typed_per_filter_config"] = example["typed_per_filter_config"]
    clusters = config["static_resources"]["clusters"]
    for candidate in settings["candidates"]:
        clusters.append({**copy.deepcopy(clusters[-1]), "name": candidate["cluster"]})
    findings = lint_text(yaml.safe_dump(config), page)
    assert findings == [], "\n".join(f.line() for f in findings)


def _find_sluice(value):
    if isinstance(value, dict):
        if "sluice" in value and isinstance(value["sluice"], dict) and "candidates" in value["sluice"]:
            return value["sluice"]
        return next((found for v in value.values() if (found := _find_sluice(v)) is not None), None)
    if isinstance(value, list):
        return next((found for v in value if (found := _find_sluice(v)) is not None), None)
    return None


def _fail_closed_override(wrapped: bool) -> dict:
    per_route = {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                 "overrides": {"failure_mode_allow": False}}
    return {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": per_route} if wrapped else per_route


@pytest.mark.parametrize("where", ["route", "route, in a FilterConfig", "virtual host"])
def test_a_guarded_route_that_fails_closed_is_clean(where):
    config = reference()
    _sluice(config)["guard"] = {"words": [{"name": "w", "words": ["x"]}]}
    scope = _hcm(config)["route_config"]["virtual_hosts"][0] if where == "virtual host" else _route(config)
    scope.setdefault("typed_per_filter_config", {})["envoy.filters.http.ext_proc"] = _fail_closed_override(
        wrapped=where != "route")
    assert lint_text(yaml.safe_dump(config), "good.yaml") == []
    # Open again on the route itself: the route's own setting wins over its host's.
    override = _fail_closed_override(wrapped=False)
    override["overrides"]["failure_mode_allow"] = True
    _route(config).setdefault("typed_per_filter_config", {})["envoy.filters.http.ext_proc"] = override
    assert [f.code for f in lint_text(yaml.safe_dump(config), "bad.yaml")] == ["guard-fails-open"]
    # A filter that fails closed needs no override.
    config = reference()
    _sluice(config)["guard"] = {"words": [{"name": "w", "words": ["x"]}]}
    _ext(config)["failure_mode_allow"] = False
    assert lint_text(yaml.safe_dump(config), "good.yaml") == []


@pytest.mark.parametrize("where", ["route", "route, in a FilterConfig", "virtual host", "route config"])
def test_a_guarded_route_that_disables_ext_proc_fails_open(where):
    # ExtProcPerRoute `disabled: true` (or a FilterConfig's) skips the filter on the route: its
    # prompts always reach the upstream unchecked, whatever failure_mode_allow says.
    config = reference()
    _sluice(config)["guard"] = {"words": [{"name": "w", "words": ["x"]}]}
    _ext(config)["failure_mode_allow"] = False
    route_config = _hcm(config)["route_config"]
    scope = {"virtual host": route_config["virtual_hosts"][0], "route config": route_config}.get(where, _route(config))
    if where == "route config":
        route_config["virtual_hosts"][0].pop("typed_per_filter_config")    # the host's entry would decide
    disabled = ({"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
                if where == "route, in a FilterConfig" else
                {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True})
    scope.setdefault("typed_per_filter_config", {})["envoy.filters.http.ext_proc"] = disabled
    assert [f.code for f in lint_text(yaml.safe_dump(config), "bad.yaml")] == ["guard-fails-open"]
    # The route's own override (more specific) runs the filter again, closed.
    if where in ("virtual host", "route config"):
        _route(config).setdefault("typed_per_filter_config", {})["envoy.filters.http.ext_proc"] = _fail_closed_override(wrapped=False)
        assert lint_text(yaml.safe_dump(config), "good.yaml") == []


def test_istio_per_route_config_is_read_under_the_filters_own_name_and_on_the_virtual_host():
    doc = yaml.safe_load((ROOT / "k8s/integrations/istio/envoyfilter.yaml").read_text())
    patches = doc["spec"]["configPatches"]
    ext_patch = next(p for p in patches if p["applyTo"] == "HTTP_FILTER")["patch"]["value"]
    ext_patch["name"] = "sluice.ext_proc"
    ext_patch["typed_config"]["failure_mode_allow"] = True
    route = {"name": "chat", "match": {"prefix": "/"}, "route": {"cluster_header": "x-sluice-cluster"},
             "metadata": {"filter_metadata": {"sluice": {"candidates": [{"cluster": "upstream_a"}],
                                                         "guard": {"words": [{"name": "w", "words": ["x"]}]}}}}}
    host = {"name": "chat", "domains": ["*"], "routes": [route],
            "typed_per_filter_config": {"sluice.ext_proc": _fail_closed_override(wrapped=False)}}
    patches.append({"applyTo": "VIRTUAL_HOST", "match": {"context": "GATEWAY"}, "patch": {"operation": "ADD", "value": host}})
    patches.append({"applyTo": "CLUSTER", "match": {"context": "GATEWAY"}, "patch": {"operation": "ADD", "value": {"name": "upstream_a"}}})
    codes = [f.code for f in lint_text(yaml.safe_dump(doc), "ef.yaml")]
    assert "guard-fails-open" not in codes, codes
    # Under the default name, which this filter does not have, the override is not this filter's.
    host["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": _fail_closed_override(wrapped=False)}
    assert "guard-fails-open" in [f.code for f in lint_text(yaml.safe_dump(doc), "ef.yaml")]
