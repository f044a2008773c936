"""The Helm chart in deploy/helm/kvgate, rendered by Helm's own Go SDK (helm-python-sdk: no helm binary
is packaged for this platform) and checked against the Kubernetes OpenAPI schemas (kubernetes-validate),
against kvgate's config schema, and against `kvgate render k8s` for the example engine."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from gateway.config import load_config
from gateway.fleet.render_k8s import render
from tests.conftest import REPO

CHART = REPO / "deploy" / "helm" / "kvgate"
K8S_VERSION = "1.37.0"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
INFERENCE_POOL = ("inference.networking.k8s.io/v1", "InferencePool")  # a CRD too: checked field by field
EPP = {"mode": "epp"}
EVERYTHING = {
    "exampleEngine": {"enabled": True},
    "redis": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "autoscaling": {"keda": {"enabled": True}, "hpa": {"enabled": True}},
    "adminKey": {"existingSecret": "kvgate-admin"},
    "control": {"expose": True},
}


def rendered(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name="kv", namespace="inference")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def test_the_image_to_build_and_publish_is_explained() -> None:
    """The chart names `kvgate:local`, which no registry has: its values and the docs say how to
    build it and get it to a cluster."""
    values = (CHART / "values.yaml").read_text()
    head = values[: values.index("\nimage:")]
    assert "docker build -f docker/Dockerfile -t kvgate:local ." in head
    assert "kind load docker-image kvgate:local" in head and "image.repository=REGISTRY/kvgate" in head
    docs = " ".join((REPO / "docs" / "kubernetes.md").read_text().split())
    assert "No kvgate image is published" in docs and "docker push REGISTRY/kvgate:TAG" in docs


def test_lint_finds_no_errors() -> None:
    assert helm.lint(str(CHART))["errors"] == []


@pytest.mark.parametrize(
    "values",
    [{}, EVERYTHING, {**EVERYTHING, "exampleEngine": {"enabled": True, "pd": True}}, {**EVERYTHING, **EPP}],
)
def test_every_manifest_validates(values: dict[str, Any]) -> None:
    docs = rendered(values)
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in {*CRDS, INFERENCE_POOL}:
            continue  # custom resources: no schema ships offline (see the README)
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert (INFERENCE_POOL in kinds) == (values.get("mode") == "epp")
    if values:
        assert CRDS <= kinds
    assert not any(kind.startswith("Cluster") for _, kind in kinds), "nothing cluster-wide"


def test_gateway_config_probes_rbac_and_rollout() -> None:
    docs = rendered(EVERYTHING)
    cm = find(docs, "ConfigMap")
    (config_text,) = cm["data"].values()
    dep = find(docs, "Deployment", "kv-kvgate")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    overrides = {
        "state": {"backend": env["KVGATE_STATE__BACKEND"], "redis_url": env["KVGATE_STATE__REDIS_URL"]}
    }
    settings = load_config(None, {**yaml.safe_load(config_text), **overrides})  # kvgate accepts it
    assert settings.pools and all(p.discovery is not None for p in settings.pools)
    assert env["KVGATE_STATE__REDIS_URL"] == "redis://kv-kvgate-redis:6379/0"
    find(docs, "Service", "kv-kvgate-redis")
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    server = settings.server
    assert pod["terminationGracePeriodSeconds"] > server.shutdown_delay_s + server.grace_period_s > 0
    assert server.shutdown_delay_s >= 2 * container["readinessProbe"]["periodSeconds"], (
        "the Service notices first"
    )
    # Least privilege: read-only on pods, in the release's namespace, for the gateway's account.
    (rule,) = find(docs, "Role")["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = find(docs, "RoleBinding")
    (subject,) = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "inference"}
    assert binding["roleRef"]["name"] == find(docs, "Role")["metadata"]["name"]
    slices = rendered({"discovery": {"resource": "endpointslices"}})
    (rule,) = find(slices, "Role")["rules"]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]


def container_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = find(docs, "Deployment", "kv-kvgate")["spec"]["template"]["spec"]["containers"]
    return container


def test_control_plane_stays_inside_the_pod_unless_exposed() -> None:
    secret = {"adminKey": {"existingSecret": "kvgate-admin"}}
    docs = rendered(secret)
    container = container_of(docs)
    env = {e["name"]: e for e in container["env"]}
    assert env["KVGATE_CONTROL__ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "kvgate-admin",
        "key": "admin-key",
    }
    assert "KVGATE_SERVER__ADMIN_KEY" not in env
    # Not exposed: it binds the pod's loopback (kubectl port-forward reaches it), no port, no Service.
    assert "KVGATE_CONTROL__HOST" not in env and env["KVGATE_CONTROL__PORT"]["value"] == "9001"
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert [s["metadata"]["name"] for s in docs if s["kind"] == "Service"] == ["kv-kvgate"]

    docs = rendered({**secret, "control": {"expose": True}})
    container = container_of(docs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = load_config(
        None, {"control": {"host": env["KVGATE_CONTROL__HOST"], "port": env["KVGATE_CONTROL__PORT"]}}
    )
    assert settings.control.host == "0.0.0.0"
    (port,) = [p for p in container["ports"] if p["name"] == "control"]
    assert port["containerPort"] == settings.control.port
    service = find(docs, "Service", "kv-kvgate-control")
    assert service["spec"]["ports"] == [
        {"name": "control", "port": 9001, "targetPort": "control", "protocol": "TCP"}
    ]
    assert [p["name"] for p in find(docs, "Service", "kv-kvgate")["spec"]["ports"]] == ["http"]
    with pytest.raises(helm.HelmRenderError, match=r"control\.expose needs adminKey\.existingSecret"):
        rendered({"control": {"expose": True}})


@pytest.mark.parametrize(
    ("pd", "pool", "roles"), [(False, "llama", ["mixed"]), (True, "llama-pd", ["prefill", "decode"])]
)
def test_example_engine_is_what_the_renderer_produces(pd: bool, pool: str, roles: list[str]) -> None:
    docs = rendered({"exampleEngine": {"enabled": True, "pd": pd}})
    settings = load_config(REPO / "config" / "k8s-vllm.yaml")
    expected = {
        (d["kind"], d["metadata"]["labels"]["kvgate.io/role"]): d
        for d in render(settings)
        if d["metadata"]["labels"]["kvgate.io/pool"] == pool
    }
    charted = {
        (d["kind"], d["metadata"]["labels"]["kvgate.io/role"]): d
        for d in docs
        if d["metadata"]["labels"].get("app.kubernetes.io/name") == "kvgate-engine"
    }
    assert sorted(charted) == sorted((kind, role) for kind in ("Deployment", "Service") for role in roles)
    for role in roles:
        want = expected[("Deployment", role)]["spec"]
        got = charted[("Deployment", role)]["spec"]
        want["template"]["spec"]["containers"][0]["image"] = got["template"]["spec"]["containers"][0]["image"]
        # Equal but for the pool's name, which the chart's values choose.
        for labels in (want["selector"]["matchLabels"], want["template"]["metadata"]["labels"]):
            labels.update(
                {k: "llama" for k in labels if k in ("kvgate.io/pool", "app.kubernetes.io/instance")}
            )
        assert got == want
        want_svc = expected[("Service", role)]["spec"]
        want_svc["selector"]["kvgate.io/pool"] = "llama"
        assert charted[("Service", role)]["spec"] == want_svc


@pytest.mark.parametrize("failure_mode", ["FailClose", "FailOpen"])
def test_epp_mode_renders_the_picker_its_service_and_an_inference_pool(failure_mode: str) -> None:
    docs = rendered({**EPP, "epp": {"inferencePool": {"failureMode": failure_mode}}})
    container = container_of(docs)
    assert container["args"][0] == "epp"
    env = {e["name"]: e.get("value") for e in container["env"]}
    (config_text,) = find(docs, "ConfigMap")["data"].values()
    settings = load_config(
        None,
        {
            **yaml.safe_load(config_text),
            "epp": {"host": env["KVGATE_EPP__HOST"], "port": env["KVGATE_EPP__PORT"]},
        },
    )
    assert settings.epp.host == "0.0.0.0"
    (grpc_port,) = [p for p in container["ports"] if p["name"] == "grpc"]
    assert grpc_port["containerPort"] == settings.epp.port == 9002
    # The protocol's gRPC health services are the probes.
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    service = find(docs, "Service", "kv-kvgate")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"] == {
        "name": "grpc",
        "port": 9002,
        "targetPort": "grpc",
        "protocol": "TCP",
        "appProtocol": "kubernetes.io/h2c",
    }
    pool = find(docs, "InferencePool")
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    ref = spec["endpointPickerRef"]
    # The v1 API's shape: the picker is this release's Service, by its gRPC port.
    assert ref == {
        "kind": "Service",
        "name": service["metadata"]["name"],
        "port": {"number": 9002},
        "failureMode": failure_mode,
    }
    assert spec["targetPorts"] == [{"number": 8000}]
    # kvgate's discovery watches the pods the pool selects.
    (discovery,) = [p.discovery for p in settings.pools if p.discovery is not None]
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    assert discovery.kubernetes.label_selector == selector


def test_epp_mode_refuses_what_the_api_would() -> None:
    with pytest.raises(helm.HelmRenderError, match="failureMode must be FailOpen or FailClose"):
        rendered({**EPP, "epp": {"inferencePool": {"failureMode": "Sometimes"}}})
    with pytest.raises(helm.HelmRenderError, match="mode must be proxy or epp"):
        rendered({"mode": "sidecar"})
    # The proxy mode has neither the picker's port nor a pool.
    docs = rendered()
    assert [p["name"] for p in container_of(docs)["ports"]] == ["http"]
    assert not [d for d in docs if d["kind"] == "InferencePool"]
