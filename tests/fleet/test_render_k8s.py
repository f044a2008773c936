"""`kvgate render k8s`: engine Deployments and Services from the launcher's own adapters, valid against
the Kubernetes OpenAPI schemas (kubernetes-validate, offline) and discoverable by kvgate's discovery."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import KubernetesDiscoveryConfig, Settings, load_config
from gateway.fleet.discovery.kubernetes import pod_endpoints
from gateway.fleet.launcher import plan_fleet
from gateway.fleet.ports import release_ports
from gateway.fleet.render_k8s import gateway_config, render
from gateway.fleet.render_k8s import main as render_main
from tests.conftest import PYTHON, REPO, subprocess_env
from tests.kube_api import parse_selector

K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate ships
MANAGED = sorted(p.name for p in (REPO / "config").glob("*.yaml") if "engines:" in p.read_text())


def normalized(argv: list[str]) -> list[str]:
    """A command line with its addresses blanked: what a cluster decides, not the pool's config."""
    out = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] in ("--host", "--port", "--disaggregation-bootstrap-port"):
            arg = "*"
        # A loopback launch publishes KV events on a Unix socket, a pod on tcp://*:PORT.
        out.append(re.sub(r"(tcp|ipc)://[^\"]+", "<endpoint>", arg))
    return out


@pytest.mark.parametrize("name", MANAGED)
def test_manifests_validate_and_carry_the_launchers_flags(name: str) -> None:
    settings = load_config(REPO / "config" / name)
    docs = render(settings, namespace="inference")
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    deployments = {
        d["metadata"]["labels"]["kvgate.io/pool"] + "/" + d["metadata"]["labels"]["kvgate.io/role"]: d
        for d in docs
        if d["kind"] == "Deployment"
    }
    for pool in settings.pools:
        if pool.engines is None:
            continue
        plans = plan_fleet(
            pool.name, pool.engines, pool.engines.model or pool.model, pool.served_model or pool.model
        )
        try:
            for plan in plans:
                dep = deployments[f"{pool.name}/{plan.role}"]
                (container,) = dep["spec"]["template"]["spec"]["containers"]
                launched = plan.argv
                if pool.engines.kind == "sim":
                    launched = ["kvgate", "sim", *launched[3:]]
                assert normalized(container["command"]) == normalized(launched)
                env = {e["name"] for e in container.get("env", [])}
                assert set(plan.env) - {"CUDA_VISIBLE_DEVICES"} <= env  # GPUs are a resource limit instead
        finally:
            release_ports([p for plan in plans for p in plan.ports])


@pytest.mark.parametrize("name", MANAGED)
def test_rendered_pods_are_what_the_gateway_config_discovers(name: str) -> None:
    settings = load_config(REPO / "config" / name)
    gw = Settings(**gateway_config(settings))  # the gateway's config is a valid config
    for doc in render(settings):
        if doc["kind"] != "Deployment":
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        pool = next(
            p
            for p in gw.pools
            if p.discovery and parse_selector(p.discovery.kubernetes.label_selector)(labels)
        )
        assert pool.engines is None and pool.name == labels["kvgate.io/pool"]
        cfg: KubernetesDiscoveryConfig = pool.discovery.kubernetes  # type: ignore[union-attr]
        pod: dict[str, Any] = {
            "metadata": {"name": "x-0", "uid": "u", "labels": labels},
            "spec": doc["spec"]["template"]["spec"],
            "status": {
                "phase": "Running",
                "podIP": "10.1.2.3",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        (ep,) = pod_endpoints(pod, cfg).values()
        source = next(p for p in settings.pools if p.name == pool.name)
        assert source.engines is not None
        assert ep.url == "http://10.1.2.3:8000" and ep.role == labels["kvgate.io/role"]
        assert (ep.kv_events == "tcp://10.1.2.3:5557") == source.engines.kv_events
        replays = source.engines.kv_events and ep.kind != "sglang"  # SGLang's replay socket is not relied on
        assert (ep.kv_events_replay == "tcp://10.1.2.3:5558") == replays
        sglang_prefill = ep.kind == "sglang" and ep.role == "prefill"
        assert (ep.bootstrap_port == 8998) == sglang_prefill


def kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "gateway", *args], capture_output=True, text=True, env=subprocess_env(), timeout=30
    )


def test_cli_prints_yaml_and_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    out = kvgate(
        "render", "k8s", str(REPO / "config" / "vllm-pd.yaml"), "--image", "vllm=registry.local/vllm:v1"
    )
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "Deployment", "Service"]
    prefill = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert prefill["image"] == "registry.local/vllm:v1"
    transfer = prefill["command"][prefill["command"].index("--kv-transfer-config") + 1]
    assert json.loads(transfer)["kv_role"] == "kv_producer"
    assert {
        "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    } in prefill["env"]
    assert render_main(["k8s", str(REPO / "config" / "vllm-pd.yaml"), "--image", "tpu=x"]) == 2
    assert render_main(["k8s", str(REPO / "config" / "canary.yaml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--image 'tpu=x'" in err[0] and "no managed pools" in err[1]
