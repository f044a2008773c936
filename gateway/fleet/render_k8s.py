"""`kvgate render k8s CONFIG`: a config's managed pools as Kubernetes engine Deployments and Services.

The engine command lines come from the same adapters the launcher uses (`gateway/fleet/engines/`), so a
pool described once runs locally (`kvgate serve`) or on Kubernetes with the same flags. Only what
a cluster decides differs: the engine binds 0.0.0.0 on fixed container ports (named, so that
discovery finds them), GPUs are a resource limit instead of CUDA_VISIBLE_DEVICES, and the NIXL side
channel advertises the pod's IP. Each role becomes one Deployment and one headless Service (its
EndpointSlices carry the Service's labels, for `resource: endpointslices` discovery), labelled as
kvgate's discovery reads them (`kvgate.io/pool`, `kvgate.io/role`, `kvgate.io/engine`).

`--gateway-config` prints the gateway's config instead: the same pools with `engines:` replaced by
`discovery.kubernetes` selecting those pods.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any

import yaml

from gateway.config import ConfigError, EngineSpec, PoolConfig, Settings, load_config
from gateway.fleet.discovery.kubernetes import (
    BOOTSTRAP_PORT_NAME,
    ENGINE_KEY,
    KV_EVENTS_PORT_NAME,
    KV_EVENTS_REPLAY_PORT_NAME,
    ROLE_KEY,
)
from gateway.fleet.engines import adapter_for_spec
from gateway.fleet.engines.base import BOOTSTRAP_PORT, KV_EVENTS_PORT, NIXL_SIDE_CHANNEL_PORT, ReplicaSlot
from gateway.fleet.engines.sim import sim_api
from gateway.fleet.replica import Role

POOL_KEY = "kvgate.io/pool"
HTTP_PORT = 8000
# Fixed container ports: each pod has its own IP, so every replica can use the same numbers.
AUX_PORTS = {KV_EVENTS_PORT: 5557, NIXL_SIDE_CHANNEL_PORT: 5600, BOOTSTRAP_PORT: 8998}
PORT_NAMES = {
    KV_EVENTS_PORT: KV_EVENTS_PORT_NAME,
    NIXL_SIDE_CHANNEL_PORT: "nixl",
    BOOTSTRAP_PORT: BOOTSTRAP_PORT_NAME,
}
DEFAULT_IMAGES = {
    "vllm": "vllm/vllm-openai:latest",
    "sglang": "lmsysorg/sglang:latest",
    "sim": "kvgate:local",
}
# While kvgate drains a terminating engine (its pod got a deletion timestamp), the engine keeps
# serving: SIGTERM comes after this preStop pause. Longer answers than this are cut.
PRE_STOP_S = 30
HF_SECRET = "hf-token"  # optional Secret with the Hugging Face token (key `token`)


def dns_name(text: str) -> str:
    """An RFC 1123 label (also a valid label value): lowercase alphanumerics and '-', at most 63."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    if not name:
        raise ValueError(f"{text!r} has no characters usable in a Kubernetes name")
    return name


def engine_kind(spec: EngineSpec) -> str:
    """The kind discovery must read the engine as (a simulator speaking SGLang's API is read as SGLang)."""
    return "sglang" if spec.kind == "sim" and sim_api(spec) == "sglang" else spec.kind


def role_groups(spec: EngineSpec) -> list[tuple[Role, int]]:
    if spec.roles is None:
        return [("mixed", spec.replicas)]
    return [("prefill", spec.roles.prefill), ("decode", spec.roles.decode)]


def engine_argv(pool: PoolConfig, role: Role) -> tuple[list[str], dict[str, str], dict[str, int]]:
    """One replica's command line, environment and named container ports, from the pool's adapter."""
    assert pool.engines is not None
    # A pod's engine listens on all its interfaces (and so publishes KV events on tcp://*:PORT).
    spec = pool.engines.model_copy(update={"host": "0.0.0.0"})
    adapter = adapter_for_spec(spec)
    aux = {name: AUX_PORTS[name] for name in adapter.aux_port_names(spec, role)}
    slot = ReplicaSlot(
        index=0,
        name=dns_name(pool.name),
        role=role,
        host=spec.host,
        port=HTTP_PORT,
        aux_ports=aux,
        kv_events=spec.kv_events,
        kv_events_replay=adapter.kv_events_replay,
    )
    model = spec.model or pool.model
    argv, env = adapter.command(spec, model, slot, pool.served_model or pool.model)
    if spec.kind == "sim" and spec.command is None:
        argv = ["kvgate", "sim", *argv[3:]]  # the launcher's `sys.executable -m gateway.sim`, in the image
    ports = {"http": HTTP_PORT}
    for name, port in aux.items():
        ports[PORT_NAMES[name]] = port
        if name == KV_EVENTS_PORT and slot.kv_events_replay_endpoint is not None:
            ports[KV_EVENTS_REPLAY_PORT_NAME] = port + 1  # the publisher's replay socket
    return argv, env, ports


def _labels(pool: PoolConfig, role: Role) -> dict[str, str]:
    assert pool.engines is not None
    return {
        "app.kubernetes.io/name": "kvgate-engine",
        "app.kubernetes.io/instance": dns_name(pool.name),
        "app.kubernetes.io/component": role,
        POOL_KEY: dns_name(pool.name),
        ROLE_KEY: role,
        ENGINE_KEY: engine_kind(pool.engines),
    }


def _container(pool: PoolConfig, role: Role, image: str) -> dict[str, Any]:
    spec = pool.engines
    assert spec is not None
    adapter = adapter_for_spec(spec)
    argv, env, ports = engine_argv(pool, role)
    env_list: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in sorted(env.items()) if k != "VLLM_NIXL_SIDE_CHANNEL_HOST"
    ]
    if "VLLM_NIXL_SIDE_CHANNEL_HOST" in env:  # peers reach the side channel on the pod's IP
        env_list.append(
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        )
    probe = {
        "httpGet": {"path": adapter.health_path, "port": "http"},
        "periodSeconds": 5,
        "timeoutSeconds": 2,
    }
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "command": argv,
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports.items()],
        # Ready once the model is loaded: kvgate sends traffic only to ready pods.
        "readinessProbe": {**probe, "failureThreshold": 3},
        "startupProbe": {
            **probe,
            "periodSeconds": 10,
            "failureThreshold": math.ceil(spec.startup_timeout_s / 10),
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_S}}},
    }
    if adapter.uses_gpus:
        env_list.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": HF_SECRET, "key": "token", "optional": True}},
            }
        )
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.tensor_parallel_size}}
        container["volumeMounts"] = [
            {"name": "shm", "mountPath": "/dev/shm"},  # NCCL and the engine's workers share memory
            {"name": "hf-cache", "mountPath": "/root/.cache/huggingface"},
        ]
    if env_list:
        container["env"] = env_list
    return container


def engine_manifests(pool: PoolConfig, namespace: str | None, images: dict[str, str]) -> list[dict[str, Any]]:
    spec = pool.engines
    assert spec is not None
    out: list[dict[str, Any]] = []
    for role, replicas in role_groups(spec):
        labels = _labels(pool, role)
        selector = {k: labels[k] for k in (POOL_KEY, ROLE_KEY)}
        name = dns_name(f"{pool.name}-{role}")
        meta: dict[str, Any] = {"name": name, "labels": labels}
        if namespace:
            meta["namespace"] = namespace
        container = _container(pool, role, images.get(spec.kind, DEFAULT_IMAGES[spec.kind]))
        pod_spec: dict[str, Any] = {
            # preStop pause, then the engine's own shutdown (spec.stop_grace_s, as the launcher allows)
            "terminationGracePeriodSeconds": PRE_STOP_S + math.ceil(spec.stop_grace_s),
            "containers": [container],
        }
        if "volumeMounts" in container:
            pod_spec["volumes"] = [
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                {"name": "hf-cache", "emptyDir": {}},
            ]
        out.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": meta,
                "spec": {
                    "replicas": replicas,
                    "selector": {"matchLabels": selector},
                    "template": {"metadata": {"labels": labels}, "spec": pod_spec},
                },
            }
        )
        service_ports = [
            {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
            for p in container["ports"]
            if p["name"] != "nixl"
        ]
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": meta,
                # Headless: no virtual IP to balance over; kvgate picks the pod (and reads the
                # EndpointSlices, which carry these labels, with `resource: endpointslices`).
                "spec": {"clusterIP": "None", "selector": selector, "ports": service_ports},
            }
        )
    return out


def render(
    settings: Settings, namespace: str | None = None, images: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Every managed pool's engine Deployments and Services."""
    out: list[dict[str, Any]] = []
    for pool in settings.pools:
        if pool.engines is not None:
            out += engine_manifests(pool, namespace, images or {})
    return out


def gateway_config(settings: Settings, namespace: str | None = None) -> dict[str, Any]:
    """The config for a gateway in the cluster: managed pools discover the rendered Deployments."""
    data = settings.model_dump(mode="json", exclude_defaults=True)
    data.setdefault("server", {})["host"] = "0.0.0.0"  # reached through its Service
    for pool_data, pool in zip(data.get("pools", []), settings.pools, strict=True):
        spec = pool_data.pop("engines", None)
        if spec is None:
            continue
        assert pool.engines is not None
        kubernetes: dict[str, Any] = {
            "label_selector": f"{POOL_KEY}={dns_name(pool.name)}",
            "port": "http",
            "kind": engine_kind(pool.engines),
        }
        if namespace:
            kubernetes["namespace"] = namespace
        pool_data["discovery"] = {"kubernetes": kubernetes}
        if pool.engines.block_size and not pool.prefix.engine_block_size:  # precise mode read it from engines
            pool_data.setdefault("prefix", {})["engine_block_size"] = pool.engines.block_size
        if pool.engines.priority_scheduling:
            pool_data["priority_scheduling"] = True
    return data


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # manifests are read by people: no &anchors for shared label maps


def dump(docs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate render", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="target", required=True)
    k8s = sub.add_parser("k8s", help="engine Deployments and Services for a config's managed pools")
    k8s.add_argument("config")
    k8s.add_argument(
        "--namespace", "-n", help="set metadata.namespace (and the gateway's discovery namespace)"
    )
    k8s.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="KIND=IMAGE",
        help=f"engine image per kind (defaults: {', '.join(f'{k}={v}' for k, v in DEFAULT_IMAGES.items())})",
    )
    k8s.add_argument(
        "--gateway-config", action="store_true", help="print the gateway's config for the cluster instead"
    )
    args = p.parse_args(argv)
    images = {}
    for item in args.image:
        kind, sep, image = item.partition("=")
        if not sep or kind not in DEFAULT_IMAGES or not image:
            print(
                f"kvgate render: --image {item!r}: expected KIND=IMAGE, KIND one of {sorted(DEFAULT_IMAGES)}",
                file=sys.stderr,
            )
            return 2
        images[kind] = image
    try:
        settings = load_config(args.config)
        if args.gateway_config:
            print(yaml.safe_dump(gateway_config(settings, args.namespace), sort_keys=False), end="")
            return 0
        docs = render(settings, args.namespace, images)
    except ConfigError as exc:
        print(f"kvgate: config error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # an engine option the adapter refuses, a name Kubernetes cannot take
        print(f"kvgate render: {exc}", file=sys.stderr)
        return 2
    if not docs:
        print("kvgate render: no managed pools (no `engines:` section in any pool)", file=sys.stderr)
        return 1
    print(dump(docs), end="")
    return 0
