"""vLLM: command line, load metrics, priority direction and its dialect (the NIXL connector,
`gateway.fleet.engines.nixl`; what steers it: `kv_transfer_params`, a data-parallel rank, its
request id, `X-Data-Parallel-Rank` and its `x-vllm-*` headers).

Flags checked against vLLM 0.33 (`vllm serve --help` and `vllm/engine/arg_utils.py`), see
docs/engines.md#engine-versions. LoRA: `--enable-lora`, `--lora-modules name=path` (the JSON form when a
parent model is named), `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`; run-time loading needs
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in the environment. Removed flags are never emitted:
`--swap-space`, `--calculate-kv-scales`.

CPU KV offload (`kv_offload`): `--kv-offloading-backend native --kv-offloading-size <GiB>`, checked
against vLLM 0.26 (`vllm/config/cache.py`, `VllmConfig._post_init_kv_transfer_config`): the size is
GiB summed over the tensor-parallel ranks, and the native backend selects the OffloadingConnector
with `cpu_bytes_to_use = size * 2**30`. Its CPU capacity in tokens is not a metric, but
`vllm:cache_config_info` carries `kv_offloading_size` and, when set, `kv_cache_memory_bytes`, and the
connector sizes its blocks as the GPU's: CPU tokens = offloaded bytes x GPU tokens / GPU KV bytes,
over the workers (the pool's routing divides by its tensor_parallel_size: the bytes are shared by
the workers, each keeping its own shard of every block).

Memory when replicas share a GPU: each vLLM instance profiles free memory at start-up, so
replicas starting together on one GPU mis-measure each other's usage when given only a fraction.
With `kv_cache_memory_bytes` set each replica gets its KV memory explicitly
(`--kv-cache-memory-bytes`, per replica); the GPU's `gpu_memory_utilization` (default 0.92) is
always split among the replicas sharing the GPU, because vLLM also checks at start-up that the
requested fraction of the GPU is free.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.config import EngineLora, EngineSpec
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines.base import (
    KV_EVENTS_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    EngineAdapter,
    ReplicaSlot,
    compact_json,
    connect_host,
    kv_events_config,
    kv_events_port_needed,
    mean,
    scan_exposition,
    split_fraction,
    total,
    valued_flags,
)
from gateway.fleet.engines.connector import Connector
from gateway.fleet.engines.nixl import NixlConnector
from gateway.fleet.replica import Role

DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
_KV_DTYPES = {"fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "bf16": "bfloat16"}
_CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
# Prompt tokens found in its prefix cache (GPU), loaded by its KV connector (the CPU tier, vLLM 0.26:
# scheduler-side counts of what it will load), and the CPU tier's load jobs (OffloadingConnector).
GPU_HITS = "vllm:prefix_cache_hits_total"
CPU_HITS = "vllm:external_prefix_cache_hits_total"
CPU_LOADS = "vllm:kv_offload_load_size_count"
_LOAD_SERIES = (RUNNING, WAITING, KV_USAGE, CACHE_CONFIG, PROMPT_TOKENS, GPU_HITS, CPU_HITS, CPU_LOADS)


class VLLMAdapter(EngineAdapter):
    kind: ClassVar[str] = "vllm"
    connector: Connector | None = NixlConnector()
    load_path: str | None = "/metrics"
    # `replay_endpoint` and `buffer_steps` (10,000 batches) of --kv-events-config, vLLM 0.26
    # (vllm/config/kv_events.py, ZmqEventPublisher in vllm/distributed/kv_events.py).
    kv_events_replay: bool = True
    control_fields: ClassVar[frozenset[str]] = NixlConnector.control_fields | {
        "data_parallel_rank",
        "request_id",
    }
    control_headers: ClassVar[frozenset[str]] = frozenset({"x-data-parallel-rank"})
    control_header_prefixes: ClassVar[tuple[str, ...]] = ("x-vllm-",)

    def executable(self, spec: EngineSpec, model: str) -> list[str]:
        return [*(spec.command or ["vllm", "serve"]), model]

    def aux_port_names(self, spec: EngineSpec, role: Role) -> tuple[str, ...]:
        names: list[str] = []
        if kv_events_port_needed(spec):
            names.append(KV_EVENTS_PORT)
        if role != "mixed" and spec.pd_transfer_backend == "nixl":
            names.append(NIXL_SIDE_CHANNEL_PORT)
        return tuple(names)

    def aux_port_span(self, spec: EngineSpec, name: str) -> int:
        # NIXL listens on VLLM_NIXL_SIDE_CHANNEL_PORT plus the worker's rank.
        if name == NIXL_SIDE_CHANNEL_PORT:
            return spec.tensor_parallel_size
        return super().aux_port_span(spec, name)

    def command(
        self, spec: EngineSpec, model: str, slot: ReplicaSlot, served_model_name: str | None = None
    ) -> tuple[list[str], dict[str, str]]:
        argv = [*self.executable(spec, model), "--host", slot.host, "--port", str(slot.port)]
        # Every answer then carries the request's X-Request-Id: what lets the gateway reuse a
        # connection to it, proving each answer is its request's (gateway/path/transports/base.py).
        argv.append("--enable-request-id-headers")
        if served_model_name and served_model_name != model:
            argv += ["--served-model-name", served_model_name]
        if spec.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
        if spec.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", _KV_DTYPES[spec.kv_cache_dtype]]
        if spec.chunked_prefill.enabled:
            argv.append("--enable-chunked-prefill")
            if spec.chunked_prefill.max_num_batched_tokens is not None:
                argv += ["--max-num-batched-tokens", str(spec.chunked_prefill.max_num_batched_tokens)]
        else:
            argv.append("--no-enable-chunked-prefill")
        argv.append("--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching")
        argv += valued_flags(
            ("--block-size", spec.block_size),
            ("--max-num-seqs", spec.max_num_seqs),
            ("--max-model-len", spec.max_model_len),
        )
        argv += self.memory_args(spec, slot)
        if spec.kv_offload is not None:
            argv += ["--kv-offloading-backend", spec.kv_offload.backend]
            argv += ["--kv-offloading-size", f"{spec.kv_offload.gib:.10g}"]
        env = self.gpu_env(slot)
        if slot.role != "mixed":
            argv += self.pd_args(spec, slot)
            if NIXL_SIDE_CHANNEL_PORT in slot.aux_ports:
                env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = connect_host(slot.host)
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(slot.aux_ports[NIXL_SIDE_CHANNEL_PORT])
        if spec.kv_events:
            argv += ["--kv-events-config", kv_events_config(slot)]
        if spec.priority_scheduling:
            argv += ["--scheduling-policy", "priority"]
        if spec.lora is not None:
            argv += self.lora_args(spec.lora)
            if spec.lora.runtime_updates:
                env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        argv += spec.extra_args
        return argv, env | spec.env

    def lora_args(self, lora: EngineLora) -> list[str]:
        args = ["--enable-lora"]
        if lora.modules:
            args.append("--lora-modules")
            for m in lora.modules:
                if m.base_model_name is None:
                    args.append(f"{m.name}={m.path}")
                else:  # only the JSON form names the parent model
                    args.append(
                        compact_json({"name": m.name, "path": m.path, "base_model_name": m.base_model_name})
                    )
        args += valued_flags(
            ("--max-loras", lora.max_loras),
            ("--max-lora-rank", lora.max_lora_rank),
            ("--max-cpu-loras", lora.max_cpu_loras),
        )
        return args

    def pd_args(self, spec: EngineSpec, slot: ReplicaSlot) -> list[str]:
        transfer = {
            "kv_connector": _CONNECTORS[spec.pd_transfer_backend],
            "kv_role": _KV_ROLES[slot.role],
            "kv_load_failure_policy": spec.pd_kv_load_failure,
        }
        return ["--kv-transfer-config", compact_json(transfer)]

    def memory_args(self, spec: EngineSpec, slot: ReplicaSlot) -> list[str]:
        args: list[str] = []
        if spec.kv_cache_memory_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
        if spec.gpu_memory_utilization is not None or slot.gpu_sharers > 1:
            util = spec.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
            args += ["--gpu-memory-utilization", split_fraction(util, slot.gpu_sharers)]
        return args

    def parse_load(self, body: bytes) -> EngineLoad:
        series = scan_exposition(body.decode(errors="replace"), _LOAD_SERIES)
        load = EngineLoad(
            running=int(total(series[RUNNING])),
            waiting=int(total(series[WAITING])),
            kv_usage=mean(series[KV_USAGE]),
        )
        blocks = cpu_tokens = 0
        for sample in series[CACHE_CONFIG]:
            labels = sample.label_map()
            try:
                engine_blocks = int(labels["num_gpu_blocks"])
                load.block_size = int(labels["block_size"])
            except (KeyError, ValueError):  # "None" before the engine finished profiling
                continue
            blocks += engine_blocks
            cpu_tokens += _cpu_tokens(labels, engine_blocks * load.block_size)
        if blocks:
            load.num_gpu_blocks = blocks  # data-parallel engines each report their own cache
        if cpu_tokens:
            load.cpu_capacity_tokens = cpu_tokens
        if series[PROMPT_TOKENS]:
            load.prompt_tokens_total = total(series[PROMPT_TOKENS])
        if series[GPU_HITS]:
            load.gpu_hit_tokens_total = total(series[GPU_HITS])
        if series[CPU_HITS]:
            load.cpu_hit_tokens_total = total(series[CPU_HITS])
        if series[CPU_LOADS]:
            load.cpu_loads_total = total(series[CPU_LOADS])
        return load

    def engine_priority(self, level: int) -> int:
        # vLLM schedules the lowest `priority` value first.
        return -level


def _cpu_tokens(labels: dict[str, str], gpu_tokens: int) -> int:
    """The CPU tier's KV tokens from cache_config_info's labels (the module docstring); 0 where it
    has none, or where the GPU's KV bytes are not given (sized from gpu_memory_utilization)."""
    try:
        gib = float(labels["kv_offloading_size"])
        gpu_bytes = int(labels["kv_cache_memory_bytes"])
    except (KeyError, ValueError):  # "None": unset
        return 0
    if gib <= 0 or gpu_bytes <= 0:
        return 0
    return int(gib * (1 << 30) * gpu_tokens / gpu_bytes)
