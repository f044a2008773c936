"""A managed fleet: the engine replicas the gateway launches, and their flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.config.base import Strict


class ChunkedPrefill(Strict):
    """Chunked prefill: long prompts prefilled in pieces between decode steps."""

    enabled: bool = Field(True, description="vLLM --enable-chunked-prefill (SGLang: its default chunking)")
    max_num_batched_tokens: int | None = Field(
        None,
        gt=0,
        description="Tokens per engine step (vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size)",
    )


class PDRoles(Strict):
    """How many of a fleet's replicas prefill and how many decode."""

    prefill: int = Field(1, ge=1, description="Prefill replicas (the first ones)")
    decode: int = Field(1, ge=1, description="Decode replicas (the rest)")


class SimOptions(Strict):
    """The bundled simulator's own flags (engines.kind sim)."""

    profile: str = Field(
        "h200-llama3.1-8b", description="The GPU and model it simulates (kvgate sim --help lists them)"
    )
    speedup: float = Field(1.0, gt=0, description="Simulated seconds per wall-clock second")
    max_waiting: int | None = Field(None, gt=0, description="Waiting requests beyond which it answers 429")
    extra_args: list[str] = Field(default_factory=list, description="More `kvgate sim` flags")


class LoraModuleSpec(Strict):
    name: str = Field(min_length=1, description="The adapter's name: what requests ask for as `model`")
    path: str = Field(min_length=1, description="Where the engine reads the adapter's weights")
    base_model_name: str | None = Field(None, description="vLLM's JSON --lora-modules form: the parent model")


class EngineLora(Strict):
    """The engines' LoRA flags (vLLM's names; SGLang's equivalents are written for an sglang fleet)."""

    modules: list[LoraModuleSpec] = Field(
        default_factory=list,
        description="Adapters every replica loads at start (vLLM --lora-modules, SGLang --lora-paths)",
    )
    max_loras: int | None = Field(
        None, gt=0, description="Adapters one batch may use (vLLM --max-loras, SGLang --max-loras-per-batch)"
    )
    max_lora_rank: int | None = Field(None, gt=0, description="Largest adapter rank (--max-lora-rank)")
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


class KVOffload(Strict):
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


class EngineSpec(Strict):
    """A managed fleet: the gateway launches and supervises these replicas."""

    kind: Literal["vllm", "sglang", "sim"] = Field(
        "sim", description="The engine launched (sim: the bundled simulator)"
    )
    model: str | None = Field(None, description="The model the engines load (unset: the pool's model)")
    replicas: int = Field(1, ge=1, description="Engine processes launched")
    host: str = Field("127.0.0.1", description="Address the engines listen on")
    base_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="First replica's port, the next ones and auxiliary ports following; unset: the first "
        "free ports from server.port + 100 (server.port 0: ports the system picks)",
    )
    gpu_ids: list[list[int]] | None = Field(
        None,
        description="GPU ids per replica (CUDA_VISIBLE_DEVICES); replicas may share one; unset: each "
        "replica its own tensor_parallel_size GPUs, in order",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica (--tensor-parallel-size)")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bf16"] = Field(
        "auto", description="--kv-cache-dtype (fp8 halves the KV cache's memory)"
    )
    chunked_prefill: ChunkedPrefill = Field(
        default_factory=ChunkedPrefill, description="Chunked prefill and its step size"
    )
    prefix_caching: bool = Field(True, description="The engines' prefix cache (what prefix routing aims at)")
    block_size: int | None = Field(
        None, gt=0, description="Tokens per KV block (vLLM --block-size, SGLang --page-size)"
    )
    max_num_seqs: int | None = Field(
        None,
        gt=0,
        description="Requests one engine runs at once (vLLM --max-num-seqs, SGLang --max-running-requests)",
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Context length in tokens (vLLM --max-model-len, SGLang --context-length)"
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of a GPU's memory for the engine (vLLM --gpu-memory-utilization, SGLang "
        "--mem-fraction-static); split among replicas sharing a GPU (docs/engines.md)",
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        gt=0,
        description="KV cache bytes per replica, instead of a fraction (vLLM --kv-cache-memory-bytes)",
    )
    kv_offload: KVOffload | None = Field(
        None, description="A CPU tier for the KV cache (vLLM --kv-offloading-backend/--kv-offloading-size)"
    )
    roles: PDRoles | None = Field(None, description="Split replicas into prefill and decode roles")
    pd_transfer_backend: Literal["nixl", "mooncake"] = Field(
        "nixl", description="How prefill replicas hand their KV to decode replicas"
    )
    pd_kv_load_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="A decode replica that cannot fetch the prompt's KV (the prefill replica died or the "
        "transfer failed) prefills it itself (recompute) or fails the request (fail, vLLM's own default)",
    )
    kv_events: bool = Field(
        False, description="Engines publish KV cache events (pools[].prefix.mode precise)"
    )
    priority_scheduling: bool = Field(
        False, description="Engines schedule by priority; each request's class is forwarded as its priority"
    )
    lora: EngineLora | None = Field(None, description="Serve LoRA adapters (--enable-lora and its limits)")
    extra_args: list[str] = Field(default_factory=list, description="More engine flags, appended as given")
    command: list[str] | None = Field(
        None, description="Replaces the engine's executable, e.g. [/opt/vllm/bin/vllm, serve]"
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables set for the engines")
    startup_timeout_s: float = Field(
        900.0, gt=0, description="A replica not healthy this long after its start is killed and restarted"
    )
    restart_backoff_s: float = Field(
        1.0,
        gt=0,
        description="Wait before restarting a replica that exited, doubled for each failure in a row",
    )
    restart_backoff_max_s: float = Field(60.0, gt=0, description="Longest wait before a restart")
    stop_grace_s: float = Field(10.0, ge=0, description="After SIGTERM, how long before SIGKILL")
    log_dir: str = Field(".kvgate/logs", description="Each replica logs to `<log_dir>/<pool>-<n>.log`")
    sim: SimOptions = Field(default_factory=SimOptions, description="The simulator's own flags (kind sim)")

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
