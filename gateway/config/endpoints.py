"""Replicas the gateway does not launch: endpoints in the config, and discovery from Kubernetes."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Strict
from gateway.config.upstream import parse_target


class KVEventsSource(Strict):
    """Where a subscriber reaches an engine's KV event publisher (ZMQ PUB)."""

    endpoint: str = Field(
        description="The address to CONNECT to, e.g. tcp://10.0.0.5:5557 for an engine started with "
        '--kv-events-config \'{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557"}\' (vLLM and '
        "SGLang bind only an endpoint holding `*`)"
    )
    topic: str = Field("", description="The publisher's topic: vLLM's and SGLang's default is empty")

    @field_validator("endpoint")
    @classmethod
    def _connectable(cls, v: str) -> str:
        if not v.startswith(("tcp://", "ipc://")):
            raise ValueError("must start with tcp:// or ipc://")
        if "*" in v:
            raise ValueError(
                f"{v!r} is the engine's bind address; give the address to connect to (its host, not `*`)"
            )
        return v


class EndpointConfig(Strict):
    """An unmanaged engine that someone else runs."""

    url: str = Field(description="The engine's base URL, http:// or https://")
    name: str | None = Field(None, description="The replica's name in metrics and logs (unset: `<pool>-<n>`)")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="mixed serves whole requests; prefill and decode split them (PD)"
    )
    kind: Literal["vllm", "sglang", "sim", "openai"] = Field(
        "vllm", description="How its load and PD protocol are read (openai: any compatible server, no load)"
    )
    bootstrap_port: int | None = Field(None, description="SGLang prefill bootstrap port")
    kv_events: KVEventsSource | None = Field(
        None,
        description="Precise mode: the engine's KV event publisher, {endpoint, topic} or just the endpoint "
        "(topic empty, the engines' default)",
    )
    device: str | None = Field(
        None,
        description="Engines that name the same device share one GPU (time-sliced between their "
        "processes): load-aware policies count their requests together",
    )
    kv_side_channel_host: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="A vLLM prefill engine's VLLM_NIXL_SIDE_CHANNEL_HOST (unset: the endpoint URL's host):"
        " a prefill answer naming another host for its KV is not relayed to a decode engine (launched"
        " engines: set by the launcher)",
    )

    @field_validator("kv_events", mode="before")
    @classmethod
    def _endpoint_only(cls, v: Any) -> Any:
        return {"endpoint": v} if isinstance(v, str) else v

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        parse_target(v)  # a host, a port in range, no spaces or control characters
        return v.rstrip("/")


class KubernetesDiscoveryConfig(Strict):
    """Replicas from the Kubernetes API: the ready pods (or EndpointSlice endpoints) a selector matches."""

    namespace: str | None = Field(
        None, description="Unset: the gateway pod's own namespace in a cluster, else the kubeconfig context's"
    )
    label_selector: str = Field(
        description="Which pods (or EndpointSlices) serve the pool, e.g. kvgate.io/pool=llama"
    )
    resource: Literal["pods", "endpointslices"] = Field(
        "pods", description="Watch pods, or the EndpointSlices of a Service"
    )
    port: int | str = Field(
        "http", description="The engine's HTTP port: a number, or a container/Service port name"
    )
    kind: Literal["vllm", "sglang", "sim", "openai"] = Field(
        "vllm", description="Engine kind when the kvgate.io/engine label or annotation is absent"
    )
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="Role when the kvgate.io/role label or annotation is absent"
    )
    auth: Literal["auto", "in_cluster", "kubeconfig"] = Field(
        "auto", description="auto: the pod's service account when in a cluster, else the kubeconfig"
    )
    kubeconfig: str | None = Field(None, description="Unset: $KUBECONFIG, else ~/.kube/config")
    context: str | None = Field(None, description="The kubeconfig context (unset: its current one)")
    service_account_dir: str = Field(
        "/var/run/secrets/kubernetes.io/serviceaccount", description="In a cluster: the pod's token and CA"
    )
    watch_timeout_s: int = Field(
        290, gt=0, description="timeoutSeconds of each watch; the watch resumes from its last resourceVersion"
    )
    request_timeout_s: float = Field(
        30.0, gt=0, description="For list requests, and for a silent watch beyond its timeout"
    )
    backoff_initial_s: float = Field(
        0.5, gt=0, description="After a failed list or watch, wait this long, doubled for each next failure"
    )
    backoff_max_s: float = Field(30.0, gt=0, description="Longest wait between two tries")
    drain_timeout_s: float = Field(
        600.0, ge=0, description="A replica that left waits this long at most for its requests in flight"
    )


class DiscoveryConfig(Strict):
    """Where a pool's replicas are discovered."""

    kubernetes: KubernetesDiscoveryConfig = Field(description="Replicas from the Kubernetes API")

    @model_validator(mode="after")
    def _client_installed(self) -> DiscoveryConfig:
        try:
            found = importlib.util.find_spec("kubernetes_asyncio") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError("needs the Kubernetes client: pip install 'kvgate[kubernetes]'")
        return self
