"""All of kvgate's settings: one validated tree, from a YAML file plus `KVGATE_*` overrides.

Environment variables override the file, nested keys joined by `__`
(`KVGATE_SERVER__PORT=9000`); a list is JSON (`'["a","b"]'`) or comma-separated (`a,b`).
Validation happens once at start; `load_config` raises `ConfigError` whose message is one line
naming the bad key and why.
"""

from __future__ import annotations

import importlib.util
import re
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)


# -- engine URLs, as the settings accept them and the transports use them ---------------------------
@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str
    # Derived once: targets are cached (parse_target), and every request reads these.
    origin: tuple[str, str, int] = field(init=False)
    host_header: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "origin", (self.scheme, self.host, self.port))
        host = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        object.__setattr__(self, "host_header", host)

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host_header}{self.path}"


_VISIBLE = re.compile(r"[\x21-\x7e]+")


@lru_cache(maxsize=4096)
def parse_target(url: str) -> Target:
    """An engine URL as the transports use it; ValueError for what no transport can send to."""
    if not _VISIBLE.fullmatch(url):  # urlsplit would silently drop a CR or LF
        raise ValueError(f"engine URL has spaces or control characters: {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine URLs are http:// or https://, not {parts.scheme!r}: {url}")
    if not parts.hostname:
        raise ValueError(f"engine URL without a host: {url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)  # ValueError when out of range
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, parts.hostname, port, path)


class ConfigError(Exception):
    """A config that cannot be served; the message is meant for one log line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantConfig(_Strict):
    name: str
    api_key: str = Field(description="Bearer key that identifies this tenant")
    max_priority: str | None = Field(None, description="Highest priority class this tenant may ask for")
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: int | None = Field(None, gt=0)
    max_prompt_tokens: int | None = Field(None, gt=0)
    prompt_overflow: Literal["reject", "window"] = "reject"
    max_concurrent_requests: int | None = Field(
        None, gt=0, description="Requests being sent or prepared at once (server.max_requests_per_tenant)"
    )


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: list[str] = Field(default_factory=list, description="Client keys; empty = no auth")
    admin_key: str | None = Field(
        None, description="Deprecated: use control.admin_key (the admin API has its own listener)"
    )
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="After decompression")
    max_json_depth: int = Field(
        64, ge=2, le=200, description="Deepest nesting of arrays and objects a request body may have"
    )
    body_timeout_s: float = Field(30.0, gt=0, description="Longest pause while a client sends its body")
    body_deadline_s: float = Field(120.0, gt=0, description="Longest time a client may take to send its body")
    max_requests_per_tenant: int = Field(
        1000,
        gt=0,
        description="A tenant's requests from head to answer at once (bodies being sent, queued); keep it"
        " below max_connections so that one key cannot hold every connection",
    )
    max_n: int = Field(128, ge=1, description="Most choices (`n`) one request may ask for")
    max_prompts: int = Field(256, ge=1, description="Most prompts in one completions batch")
    max_inputs: int = Field(
        2048, ge=1, description="Most inputs of one embeddings/pooling/classify request (documents: rerank)"
    )
    offload_body_bytes: int = Field(
        128 * 1024, ge=0, description="Larger bodies are canonicalized and hashed in a worker thread"
    )
    grace_period_s: float = Field(30.0, ge=0)
    shutdown_delay_s: float = Field(
        0.0,
        ge=0,
        description="On SIGTERM, fail /ready and keep serving this long before closing the listener, so a "
        "load balancer (a Kubernetes Service) stops sending first; grace_period_s starts after it",
    )
    header_timeout_s: float = Field(10.0, gt=0, description="A new connection's first request head")
    keepalive_timeout_s: float = Field(75.0, gt=0, description="An idle connection between requests")
    max_connections: int = Field(
        10_000, gt=0, description="Client connections; lowered at start if file descriptors cannot cover it"
    )
    reserved_connections: int = Field(
        32, ge=0, description="Beyond max_connections: answered for /health, /ready and /live only"
    )
    impl: Literal["httptools", "aiohttp"] = Field(
        "httptools",
        description="The data plane's HTTP server: kvgate's lean one on llhttp, or aiohttp's; same routes, "
        "limits and behaviour",
    )
    access_log: bool = True
    log_json: bool = False
    log_level: str = "info"
    ready: Literal["any", "all"] | list[str] = Field(
        "any",
        description="When /ready answers 200: `any` pool has a healthy replica, `all` pools do, or "
        "every pool of a list does (never while draining)",
    )


class ControlConfig(_Strict):
    """The control plane: the admin API (and its OpenAPI schema and docs page) on a listener of its
    own, never on the data plane's port."""

    host: str = "127.0.0.1"
    port: int = Field(9001, ge=0, le=65535, description="0: a free port, picked at start")
    admin_key: str | None = Field(
        None, description="Bearer key every /admin route needs; unset = no control listener at all"
    )
    max_connections: int = Field(
        32, gt=0, description="Connections served at once; beyond it, 503 until one closes"
    )
    idle_timeout_s: float = Field(
        5.0, gt=0, description="A connection silent this long is closed, before its first request too"
    )
    header_timeout_s: float = Field(
        5.0, gt=0, description="A request head must be whole this long after its connection or first byte"
    )
    max_connections_per_address: int = Field(
        8, gt=0, description="Connections from one peer address (its longest waiting one gives way)"
    )


class UpstreamTLS(_Strict):
    verify: bool = Field(
        True, description="Check engines' certificates and host names; false only on purpose"
    )
    ca_file: str | None = Field(None, description="PEM bundle to trust instead of the system's CAs")


class UpstreamConfig(_Strict):
    transport: Literal["http1", "aiohttp"] = Field(
        "http1", description="http1: kvgate's own client (fast); aiohttp: aiohttp's client (fallback)"
    )
    connect_timeout_s: float = Field(5.0, gt=0)
    first_byte_timeout_s: float = Field(
        300.0, gt=0, description="Until the engine's response headers, waiting for a free connection included"
    )
    idle_timeout_s: float = Field(120.0, gt=0, description="Between two body chunks")
    max_connections: int = Field(4096, gt=0, description="Per engine host:port, idle ones included")
    max_response_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Largest non-streamed engine answer (streams are relayed as they come)",
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest response head (status line, headers)"
    )
    max_headers: int = Field(100, ge=8, description="Most headers in one engine response")
    reuse_unverified_connections: bool = Field(
        False,
        description="Reuse connections to engines that do not echo X-Request-Id (a late stray answer"
        " from such an engine could then reach another request)",
    )
    tls: UpstreamTLS = Field(default_factory=UpstreamTLS)


class RetryConfig(_Strict):
    max_attempts: int = Field(3, ge=1, description="Total tries, first included")
    backoff_initial_s: float = Field(0.02, ge=0)
    backoff_max_s: float = Field(0.5, ge=0)
    budget_ratio: float = Field(
        0.2, ge=0, description="Retries allowed as a fraction of recent requests (plus a floor of 10)"
    )
    retry_statuses: list[int] = Field(default_factory=lambda: [429, 502, 503, 504])


class HealthConfig(_Strict):
    enabled: bool = True
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    failure_threshold: int = Field(2, ge=1)
    success_threshold: int = Field(1, ge=1)
    path: str = "/health"


class BreakerConfig(_Strict):
    failure_threshold: int = Field(5, ge=1, description="Consecutive failures that open the circuit")
    open_s: float = Field(10.0, gt=0, description="How long an open circuit rejects before a probe")


class ScrapeConfig(_Strict):
    interval_s: float = Field(0.5, gt=0)
    stale_after_s: float = Field(3.0, gt=0)


class ChunkedPrefill(_Strict):
    enabled: bool = True
    max_num_batched_tokens: int | None = Field(None, gt=0)


class PDRoles(_Strict):
    prefill: int = Field(1, ge=1)
    decode: int = Field(1, ge=1)


class SimOptions(_Strict):
    profile: str = "h200-llama3.1-8b"
    speedup: float = Field(1.0, gt=0)
    max_waiting: int | None = Field(None, gt=0)
    extra_args: list[str] = Field(default_factory=list)


class LoraModuleSpec(_Strict):
    name: str = Field(min_length=1, description="The adapter's name: what requests ask for as `model`")
    path: str = Field(min_length=1, description="Where the engine reads the adapter's weights")
    base_model_name: str | None = Field(None, description="vLLM's JSON --lora-modules form: the parent model")


class EngineLora(_Strict):
    """The engines' LoRA flags (vLLM's names; SGLang's equivalents are written for an sglang fleet)."""

    modules: list[LoraModuleSpec] = Field(
        default_factory=list,
        description="Adapters every replica loads at start (vLLM --lora-modules, SGLang --lora-paths)",
    )
    max_loras: int | None = Field(
        None, gt=0, description="Adapters one batch may use (vLLM --max-loras, SGLang --max-loras-per-batch)"
    )
    max_lora_rank: int | None = Field(None, gt=0, description="--max-lora-rank")
    max_cpu_loras: int | None = Field(
        None,
        gt=0,
        description="Adapters kept in CPU memory (vLLM --max-cpu-loras, SGLang --max-loaded-loras)",
    )
    runtime_updates: bool = Field(
        False,
        description="Allow loading adapters at run time (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); "
        "pools[].lora.load_on_demand needs it",
    )


class KVOffload(_Strict):
    """CPU memory per replica for KV blocks evicted from (and written through from) the GPU."""

    size_gib: float | None = Field(None, gt=0, description="GiB per replica (summed over its TP ranks)")
    size_bytes: int | None = Field(None, gt=0, description="Bytes per replica, instead of size_gib")
    backend: Literal["native", "lmcache"] = Field(
        "native", description="vLLM's --kv-offloading-backend: native is the OffloadingConnector"
    )

    @model_validator(mode="after")
    def _one_size(self) -> KVOffload:
        if (self.size_gib is None) == (self.size_bytes is None):
            raise ValueError("set exactly one of size_gib and size_bytes")
        return self

    @property
    def gib(self) -> float:
        return self.size_gib if self.size_gib is not None else (self.size_bytes or 0) / (1 << 30)


class EngineSpec(_Strict):
    """A managed fleet: the gateway launches and supervises these replicas."""

    kind: Literal["vllm", "sglang", "sim"] = "sim"
    model: str | None = Field(None, description="Defaults to the pool's model")
    replicas: int = Field(1, ge=1)
    host: str = "127.0.0.1"
    base_port: int | None = Field(None, ge=1, le=65535, description="Unset: free ports are allocated")
    gpu_ids: list[list[int]] | None = Field(None, description="GPU ids per replica (CUDA_VISIBLE_DEVICES)")
    tensor_parallel_size: int = Field(1, ge=1)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bf16"] = "auto"
    chunked_prefill: ChunkedPrefill = Field(default_factory=ChunkedPrefill)
    prefix_caching: bool = True
    block_size: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    kv_offload: KVOffload | None = Field(
        None, description="A CPU tier for the KV cache (vLLM --kv-offloading-backend/--kv-offloading-size)"
    )
    roles: PDRoles | None = Field(None, description="Split replicas into prefill and decode roles")
    pd_transfer_backend: Literal["nixl", "mooncake"] = "nixl"
    pd_kv_load_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="A decode replica that cannot fetch the prompt's KV (the prefill replica died or the "
        "transfer failed) prefills it itself (recompute) or fails the request (fail, vLLM's own default)",
    )
    kv_events: bool = False
    priority_scheduling: bool = False
    lora: EngineLora | None = Field(None, description="Serve LoRA adapters (--enable-lora and its limits)")
    extra_args: list[str] = Field(default_factory=list)
    command: list[str] | None = Field(
        None, description="Replaces the engine's executable, e.g. [/opt/vllm/bin/vllm, serve]"
    )
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(900.0, gt=0)
    restart_backoff_s: float = Field(1.0, gt=0)
    restart_backoff_max_s: float = Field(60.0, gt=0)
    stop_grace_s: float = Field(10.0, ge=0)
    log_dir: str = ".kvgate/logs"
    sim: SimOptions = Field(default_factory=SimOptions)

    @model_validator(mode="after")
    def _roles_fit(self) -> EngineSpec:
        if self.roles and self.roles.prefill + self.roles.decode != self.replicas:
            raise ValueError(
                f"roles.prefill + roles.decode ({self.roles.prefill + self.roles.decode}) "
                f"must equal replicas ({self.replicas})"
            )
        if self.gpu_ids is not None and len(self.gpu_ids) != self.replicas:
            raise ValueError(f"gpu_ids needs one entry per replica ({self.replicas})")
        return self


class KVEventsSource(_Strict):
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


class EndpointConfig(_Strict):
    """An unmanaged engine that someone else runs."""

    url: str
    name: str | None = None
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    kind: Literal["vllm", "sglang", "sim", "openai"] = "vllm"
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
        description="A vLLM prefill engine's VLLM_NIXL_SIDE_CHANNEL_HOST: a prefill answer naming another "
        "host for its KV is not relayed to a decode engine (launched engines: set by the launcher)",
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


class KubernetesDiscoveryConfig(_Strict):
    """Replicas from the Kubernetes API: the ready pods (or EndpointSlice endpoints) a selector matches."""

    namespace: str | None = Field(
        None, description="Unset: the gateway pod's own namespace in a cluster, else the kubeconfig context's"
    )
    label_selector: str = Field(
        description="Which pods (or EndpointSlices) serve the pool, e.g. kvgate.io/pool=llama"
    )
    resource: Literal["pods", "endpointslices"] = "pods"
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
    context: str | None = None
    service_account_dir: str = "/var/run/secrets/kubernetes.io/serviceaccount"
    watch_timeout_s: int = Field(
        290, gt=0, description="timeoutSeconds of each watch; the watch resumes from its last resourceVersion"
    )
    request_timeout_s: float = Field(
        30.0, gt=0, description="For list requests, and for a silent watch beyond its timeout"
    )
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)
    drain_timeout_s: float = Field(
        600.0, ge=0, description="A replica that left waits this long at most for its requests in flight"
    )


class DiscoveryConfig(_Strict):
    kubernetes: KubernetesDiscoveryConfig

    @model_validator(mode="after")
    def _client_installed(self) -> DiscoveryConfig:
        try:
            found = importlib.util.find_spec("kubernetes_asyncio") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError("needs the Kubernetes client: pip install 'kvgate[kubernetes]'")
        return self


class PolicyConfig(_Strict):
    type: str = "prefix_affinity"
    args: dict[str, Any] = Field(default_factory=dict)
    max_candidates: int = Field(
        32,
        ge=0,
        description="In a pool of more replicas than this, a policy that uses prefix matches is offered "
        "only the replicas holding the most of the prompt's prefix (up to half of this) and a random "
        "sample of the others, plus any replica sharing a device with one of them: its decision time "
        "stops growing with the pool. 0: always every replica",
    )


class CanonicalizeRule(_Strict):
    name: str
    pattern: str = Field(description="Python regex matching a volatile fragment")


class CanonicalizeConfig(_Strict):
    enabled: bool = False
    move_volatile_to_end: bool = True
    rules: list[CanonicalizeRule] = Field(default_factory=list)
    builtin_rules: list[str] = Field(
        default_factory=lambda: ["iso_datetime", "date", "time", "uuid"],
        description="Named built-in patterns to apply in addition to rules",
    )
    sort_tools: bool = True
    normalize_whitespace: bool = True
    opt_out_header: str = "x-kvgate-no-canonicalize"


class PrefixConfig(_Strict):
    block_chars: int = Field(64, ge=8, description="Characters per hashed block (about 16 tokens)")
    max_blocks_per_replica: int | None = Field(
        None, gt=0, description="Index bound; unset: sized from the engine's KV capacity"
    )
    default_blocks_per_replica: int = Field(65536, gt=0)
    token_cache_entries: int = Field(
        200_000, gt=0, description="Token counts of prompt blocks kept per pool (about 200 bytes each)"
    )
    speculative_ttl_s: float = Field(2.0, gt=0)
    max_learn_blocks: int = Field(
        8192,
        gt=0,
        description="Leading blocks of one prompt the index learns (about 130k tokens): a longer prompt "
        "is routed by its head, and learning all of it would hold the event loop",
    )
    mode: Literal["approximate", "precise"] = Field(
        "approximate",
        description="approximate: text blocks learned from routing decisions; precise: the engine's "
        "token ids (POST /tokenize) matched against its KV events",
    )
    engine_block_size: int | None = Field(
        None, gt=0, description="Precise mode: tokens per engine KV block (unset: engines.block_size or 16)"
    )
    kv_events_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Precise mode: a replica whose KV events have not come this long after a request "
        "was routed to it is reported (metric, warning, dashboard) and routed by the approximate index "
        "until they come again",
    )


class ClientPassthrough(_Strict):
    """Engine-steering input a pool's clients may send through (see gateway/path/sanitize.py)."""

    body_fields: list[str] = Field(
        default_factory=list, description="e.g. kv_transfer_params, for engines that take it from clients"
    )
    headers: list[str] = Field(
        default_factory=list, description="e.g. x-sim-fault, for fault-injection tests against the simulator"
    )


class FailoverConfig(_Strict):
    """Continuing an answer on another replica when its engine fails mid-answer (docs/failover.md)."""

    mid_stream: bool = Field(
        True, description="Continue chat and completions answers whose attempt failed after it began"
    )
    max_resumes: int = Field(1, ge=0, description="Continuations one answer may take")
    non_streamed: bool = Field(
        False,
        description="Continue non-streamed answers too: engines are asked for them as streams, assembled "
        "here (the body then holds id, created, model, text, finish and stop reason, usage: an engine's "
        "other fields are not carried, hence opt-in)",
    )


class PDConfig(_Strict):
    min_uncached_tokens: int = Field(512, ge=0, description="Disaggregate only above this many new tokens")
    max_transfer_tokens: int = Field(
        0,
        ge=0,
        description="Disaggregate only while the prompts of hand-offs whose decode leg has not begun to"
        " answer (their KV in transfer) hold fewer tokens than this; beyond, the decode replica prefills"
        " the request itself (0: no bound). Size it as the link's bytes/s over the KV bytes per token,"
        " times the queueing accepted (docs/engines.md)",
    )
    prefill_policy: PolicyConfig | None = Field(
        None,
        description="Deprecated (removed in the next release): a second policy for the prefill leg. "
        "Unset, the pool's policy picks both legs (select_pair; by default the prefill leg by least load)",
    )


Task = Literal["generate", "embed", "classify", "score"]


class AdapterSpec(_Strict):
    name: str = Field(min_length=1, max_length=256, description="The adapter's name at the engines")
    path: str | None = Field(None, min_length=1, description="Where an engine loads it from (load_on_demand)")


class PoolLoraConfig(_Strict):
    """The LoRA adapters a pool's replicas serve, as routing facts."""

    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        description="Adapters clients may ask for by name; taken to be on every replica unless `discover` "
        "reads a replica's own list or `load_on_demand` loads them (engines.lora.modules are added)",
    )
    discover: bool = Field(
        False, description="Learn each replica's adapters (and max_model_len) from its /v1/models"
    )
    discover_interval_s: float = Field(10.0, gt=0)
    load_on_demand: bool = Field(
        False,
        description="Load a declared adapter onto a replica that lacks it (POST /v1/load_lora_adapter "
        "with its path) before sending it the request",
    )
    load_timeout_s: float = Field(120.0, gt=0)
    load_retry_s: float = Field(
        10.0, gt=0, description="After a failed load, wait this long before trying that replica again"
    )
    affinity_tokens: int = Field(
        512,
        ge=0,
        description="Prefix-aware policies: an adapter believed resident on a replica counts as this "
        "many cached prompt tokens there (a swap-in, and a batch slot)",
    )
    slots_per_replica: int | None = Field(
        None, gt=0, description="Adapters a replica keeps resident (default: engines.lora.max_loras, else 1)"
    )

    @model_validator(mode="after")
    def _loadable(self) -> PoolLoraConfig:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must be unique: {names}")
        if self.load_on_demand:
            missing = [a.name for a in self.adapters if a.path is None]
            if missing:
                raise ValueError(f"load_on_demand needs a path for every adapter; missing: {missing}")
        return self


class PoolConfig(_Strict):
    name: str
    model: str = Field(description="Model name the engines serve")
    served_model: str | None = Field(None, description="Rewrite `model` to this upstream (default: model)")
    tasks: list[Task] = Field(
        default_factory=lambda: list[Task](["generate"]),
        min_length=1,
        description="What the pool's engines serve: generate (chat, completions, responses), embed "
        "(embeddings, pooling, score, rerank), classify (classify, pooling), score (score, rerank, pooling)",
    )
    lora: PoolLoraConfig = Field(default_factory=PoolLoraConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    canonicalize: CanonicalizeConfig = Field(default_factory=CanonicalizeConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    pd: PDConfig = Field(default_factory=PDConfig)
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    engines: EngineSpec | None = None
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig | None = Field(
        None,
        description="Replicas discovered from Kubernetes, joining and leaving as pods become ready or go",
    )
    tokenizer: str | None = Field(
        None,
        description="The engines' tokenizer, so that index sizing and job sizes are in their tokens: a "
        "tokenizer.json (or a model directory holding one; needs kvgate[tokenizers]), builtin:words or "
        "builtin:cl100k. Unset: a managed pool's --tokenizer flag or local model directory (vllm and "
        "sglang: also the Hugging Face cache), else cl100k counts corrected by the tokens per "
        "character learned from the engines' usage figures (or their prompt token counters)",
    )
    client_passthrough: ClientPassthrough = Field(default_factory=ClientPassthrough)
    priority_scheduling: bool = Field(
        False,
        description="The (unmanaged) endpoints run priority scheduling: forward each request's priority "
        "(managed fleets: engines.priority_scheduling)",
    )

    @model_validator(mode="after")
    def _has_replicas(self) -> PoolConfig:
        if self.engines is None and not self.endpoints and self.discovery is None:
            raise ValueError("needs `engines` (managed), `endpoints` (unmanaged) or `discovery`")
        if self.engines is not None and self.discovery is not None:
            raise ValueError("`engines` (launched here) and `discovery` exclude each other")
        if self.lora.load_on_demand and self.engines is not None:
            lora = self.engines.lora
            if self.engines.kind != "sglang" and (lora is None or not lora.runtime_updates):
                raise ValueError("lora.load_on_demand needs engines.lora.runtime_updates: true")
        if self.prefix.mode == "precise" and not (
            (self.engines is not None and self.engines.kv_events)
            or any(e.kv_events for e in self.endpoints)
            or self.discovery is not None  # each pod names its publisher (kvgate.io/kv-events-port)
        ):
            raise ValueError(
                "prefix.mode precise needs KV events: set engines.kv_events: true or endpoints[].kv_events"
            )
        return self

    @property
    def adapter_specs(self) -> list[AdapterSpec]:
        """Declared adapters: `lora.adapters`, then the managed engines' `--lora-modules`."""
        out = list(self.lora.adapters)
        names = {a.name for a in out}
        if self.engines is not None and self.engines.lora is not None:
            out += [
                AdapterSpec(name=m.name, path=m.path)
                for m in self.engines.lora.modules
                if m.name not in names
            ]
        return out

    @property
    def engine_block_size(self) -> int:
        """Tokens per engine KV block, as precise mode hashes them (vLLM's and the simulator's default 16)."""
        engines_bs = self.engines.block_size if self.engines is not None else None
        return self.prefix.engine_block_size or engines_bs or 16


class HeaderMatch(_Strict):
    headers: dict[str, str] = Field(default_factory=dict)


class WeightedPool(_Strict):
    name: str
    weight: float = Field(100.0, ge=0)
    adapter: str | None = Field(None, description="Serve the route with this LoRA adapter of the pool")


class StickyConfig(_Strict):
    key: str = Field(
        "header:x-user-id|body:user",
        description="Sources tried in order, `|`-separated: header:NAME (e.g. a session id) or body:FIELD",
    )
    salt: str = ""

    @field_validator("key")
    @classmethod
    def _sources(cls, v: str) -> str:
        for part in v.split("|"):
            kind, _, name = part.strip().partition(":")
            if kind not in ("header", "body") or not name:
                raise ValueError(f"source {part.strip()!r}: expected header:NAME or body:FIELD")
        return v


class RouteRule(_Strict):
    match: HeaderMatch | None = None
    pools: list[WeightedPool] = Field(min_length=1)
    sticky: StickyConfig | None = None


class RouteConfig(_Strict):
    model: str = Field(description="The model name clients ask for")
    rules: list[RouteRule] = Field(min_length=1)
    rewrite_model: bool = Field(
        True,
        description="Responses name the model as the client asked for it, not the engine's name for it "
        "(a canary's internal model name never reaches clients)",
    )


class PriorityClass(_Strict):
    name: str
    level: int = Field(description="Higher runs first")
    max_queue: int = Field(1000, ge=0)
    reserved_per_replica: int = Field(
        0, ge=0, description="In-flight slots per replica that lower classes may not take (kept for this one)"
    )


class SchedulerConfig(_Strict):
    enabled: bool = True
    max_queue: int = Field(1000, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    classes: list[PriorityClass] = Field(
        default_factory=lambda: [
            PriorityClass(name="interactive", level=2),
            PriorityClass(name="default", level=1),
            PriorityClass(name="batch", level=0),
        ]
    )
    default_class: str = "default"
    sjf: bool = True
    aging_s: float = Field(10.0, gt=0, description="Wait after which a request outranks any shorter job")
    max_waiting_per_replica: int = Field(4, ge=0, description="Engine waiting queue above this: no headroom")
    max_kv_usage: float = Field(0.95, gt=0, le=1)
    max_inflight_tokens_per_replica: int | None = Field(None, gt=0)
    max_inflight_requests_per_replica: int = Field(256, gt=0)
    expected_output_tokens: int = Field(256, gt=0, description="Assumed when max_tokens is absent")
    max_expected_output_tokens: int = Field(
        2048, gt=0, description="A larger max_tokens counts as this much in the job-size estimate"
    )
    recheck_interval_s: float = Field(
        0.05, gt=0, description="While requests queue, re-check headroom this often (engine figures move)"
    )
    max_prompt_tokens: int | None = Field(None, gt=0, description="Per request, unless the tenant sets one")
    prompt_overflow: Literal["reject", "window"] = "reject"
    retry_after_s: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _default_known(self) -> SchedulerConfig:
        names = [c.name for c in self.classes]
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of {names}")
        return self


class StateConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvgate"
    sync_interval_s: float = Field(0.2, gt=0)
    instance_ttl_s: float = Field(10.0, gt=0)


class EppConfig(_Strict):
    """`kvgate epp`: the Endpoint Picker an Envoy gateway asks over ext_proc (gRPC) which endpoint
    serves each request (docs/epp.md). The request limits are the data plane's (`server.*`)."""

    host: str = "127.0.0.1"
    port: int = Field(9002, ge=0, le=65535, description="The ext_proc and gRPC health port (GIE's default)")
    fallback_endpoints: int | None = Field(
        None,
        ge=1,
        description="Endpoints in x-gateway-destination-endpoint, best first, for the gateway's retries "
        "(unset: retry.max_attempts)",
    )
    objectives: dict[str, str] = Field(
        default_factory=dict,
        description="x-gateway-inference-objective name -> priority class; an objective naming a class "
        "needs no entry, an unknown one runs in the request's own class",
    )
    max_request_messages: int = Field(
        65_536, gt=0, description="ext_proc messages one request's headers and body may take"
    )
    max_response_buffer_bytes: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description="A JSON answer whose model name is rewritten is held whole up to this; past it, "
        "relayed as it is",
    )
    max_concurrent_streams: int = Field(10_000, gt=0, description="ext_proc streams served at once")


class TelemetryConfig(_Strict):
    metrics: bool = True
    tracing: bool = False
    service_name: str = "kvgate"


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_origin(annotation) is list or annotation is list


class _EnvSource(EnvSettingsSource):
    """`KVGATE_*` variables, where a list may also be written comma-separated (`a,b`)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            if isinstance(value, str) and field is not None and _is_list(field.annotation):
                return [item.strip() for item in value.split(",") if item.strip()]
            raise


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    epp: EppConfig = Field(default_factory=EppConfig)
    tenants: list[TenantConfig] = Field(default_factory=list)
    pools: list[PoolConfig] = Field(default_factory=list)
    routes: list[RouteConfig] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment wins over the file (the file arrives as init kwargs).
        return (_EnvSource(settings_cls), init_settings)

    @model_validator(mode="after")
    def _admin_key(self) -> Settings:
        """`server.admin_key`, from before the control plane had its own listener, still works."""
        old, new = self.server.admin_key, self.control.admin_key
        if old and new and old != new:
            raise ValueError("server.admin_key (deprecated) and control.admin_key differ: keep control's")
        if old and not new:
            self.control.admin_key = old
        return self

    def deprecations(self) -> list[str]:
        """What the settings use that is deprecated, one line each, to be logged at start."""
        if self.server.admin_key:
            return ["server.admin_key is deprecated: use control.admin_key (KVGATE_CONTROL__ADMIN_KEY)"]
        return []

    @model_validator(mode="after")
    def _objectives(self) -> Settings:
        classes = [c.name for c in self.scheduler.classes]
        for objective, name in self.epp.objectives.items():
            if name not in classes:
                raise ValueError(f"epp.objectives.{objective}: {name!r} is not a class of {classes}")
        return self

    @model_validator(mode="after")
    def _cross_refs(self) -> Settings:
        pool_names = [p.name for p in self.pools]
        if len(set(pool_names)) != len(pool_names):
            raise ValueError(f"pool names must be unique: {pool_names}")
        pools = {p.name: p for p in self.pools}
        for i, route in enumerate(self.routes):
            for j, rule in enumerate(route.rules):
                names = [wp.name for wp in rule.pools]
                if len(set(names)) != len(names):
                    raise ValueError(f"routes.{i}.rules.{j}: a pool may appear once per rule: {names}")
                for wp in rule.pools:
                    if wp.name not in pool_names:
                        raise ValueError(f"routes.{i}.rules.{j}: unknown pool {wp.name!r}")
                    pool = pools[wp.name]
                    declared = {a.name for a in pool.adapter_specs}
                    if wp.adapter is not None and wp.adapter not in declared and not pool.lora.discover:
                        raise ValueError(
                            f"routes.{i}.rules.{j}: pool {wp.name!r} declares no adapter {wp.adapter!r} "
                            "(pools[].lora.adapters, engines.lora.modules, or lora.discover)"
                        )
        models = {p.model for p in self.pools}
        for p in self.pools:
            clash = sorted(models & {a.name for a in p.adapter_specs})
            if clash:
                raise ValueError(f"pool {p.name!r}: adapter names {clash} are also pool model names")
        if isinstance(self.server.ready, list):
            unknown = [name for name in self.server.ready if name not in pool_names]
            if unknown or not self.server.ready:
                what = unknown or "an empty list"
                raise ValueError(f"server.ready: {what}: expected names of pools {pool_names}")
        _check_ports(self)
        classes = {c.name for c in self.scheduler.classes}
        for t in self.tenants:
            if t.max_priority is not None and t.max_priority not in classes:
                raise ValueError(f"tenant {t.name!r}: max_priority {t.max_priority!r} is not a class")
        return self

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)


_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _same_socket(a: tuple[str, int], b: tuple[str, int], *, listeners: bool) -> bool:
    """Are `a` (a listener) and `b` (another listener, else an engine's address) one port of this
    host? A wildcard listener takes the port on every address; an engine's address is this host's
    only when it is a loopback or wildcard one, or the listener's own."""
    (host_a, port_a), (host_b, port_b) = a, b
    if port_a != port_b:
        return False
    local = _LOOPBACK | _WILDCARDS
    if host_a == host_b or (host_a in local and host_b in local):
        return True
    return listeners and (host_a in _WILDCARDS or host_b in _WILDCARDS)


def _check_ports(settings: Settings) -> None:
    """No two of the gateway's listeners, its launched engines (with a `base_port`) and the engines it
    is told to reach share a port of this host: a control port that is also an engine's address
    would send the engine's requests to the admin API."""
    listeners: list[tuple[str, tuple[str, int]]] = []
    if settings.server.port:
        listeners.append(("server.port", (settings.server.host, settings.server.port)))
    if settings.control.admin_key and settings.control.port:
        listeners.append(("control.port", (settings.control.host, settings.control.port)))
    for i, pool in enumerate(settings.pools):
        spec = pool.engines
        if spec is not None and spec.base_port:
            for n in range(spec.replicas):
                listeners.append((f"pools.{i}.engines.base_port", (spec.host, spec.base_port + n)))
    targets: list[tuple[str, tuple[str, int]]] = []
    for i, pool in enumerate(settings.pools):
        for j, ep in enumerate(pool.endpoints):
            target = parse_target(ep.url)
            targets.append((f"pools.{i}.endpoints.{j} ({ep.url})", (target.host, target.port)))
    for k, (name, address) in enumerate(listeners):
        clashes = [o for o, there in listeners[k + 1 :] if _same_socket(address, there, listeners=True)]
        clashes += [o for o, there in targets if _same_socket(address, there, listeners=False)]
        if clashes:
            raise ValueError(
                f"{name} {address[1]} is also {clashes[0]}'s port: each listener and engine needs its own"
            )


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{key}: {first['msg']}{more}"


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Read, merge and validate; every failure becomes a one-line ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            raw = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded or {}
    data.update(overrides or {})
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
    except SettingsError as exc:  # an environment value that cannot be read at all
        message = str(exc).splitlines()[0].replace('source "_EnvSource"', "the KVGATE_* environment")
        raise ConfigError(message) from None
