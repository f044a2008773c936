"""SGLang: command line, load figures, priority direction and its dialect (the bootstrap
connector, `gateway.fleet.engines.bootstrap`; LoRA adapters named `base:adapter`; what steers it:
`bootstrap_*`, data-parallel ranks, `rid`, a serialized custom logit processor, `x-sglang-*`).

Flags checked against SGLang 0.5.23 (`python -m sglang.launch_server --help`,
`sglang/srt/server_args.py`), see /work/shared/engines.md. Differences from vLLM kept here:
FP8 KV is spelled `fp8_e4m3`; chunked prefill is a size (-1 disables it); prefix caching is the
radix cache (on unless disabled); PD uses `--disaggregation-mode` with a bootstrap port on each
prefill replica and the concurrent bootstrap hand-off; `priority` runs higher values first. LoRA
(docs/advanced_features/lora.md, server_args.py): `--enable-lora`, `--lora-paths name=path ...`,
`--max-loras-per-batch`, `--max-lora-rank`, `--max-loaded-loras` (CPU-resident adapters); adapters
are loaded at run time on `/load_lora_adapter` and named `base:adapter` in OpenAI requests.

Memory when replicas share a GPU: `--mem-fraction-static` (default 0.88 here) is split among
them. SGLang has no per-instance KV byte budget, so `kv_cache_memory_bytes` is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from gateway.config import EngineLora, EngineSpec
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines.base import (
    BOOTSTRAP_PORT,
    KV_EVENTS_PORT,
    EngineAdapter,
    ReplicaSlot,
    flag_value,
    kv_events_config,
    kv_events_port_needed,
    mean,
    scan_exposition,
    split_fraction,
    total,
    valued_flags,
)
from gateway.fleet.engines.bootstrap import BootstrapConnector
from gateway.fleet.engines.connector import Connector
from gateway.fleet.replica import Role

DEFAULT_MEM_FRACTION_STATIC = 0.88
DEFAULT_KV_EVENTS_PAGE_SIZE = 16  # precise mode's default engine block (PoolConfig.engine_block_size)
_KV_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "bf16": "bf16"}

RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
TOKEN_USAGE = "sglang:token_usage"
MAX_TOKENS = "sglang:max_total_num_tokens"
_LOAD_SERIES = (RUNNING, WAITING, TOKEN_USAGE, MAX_TOKENS)


class SGLangAdapter(EngineAdapter):
    kind: ClassVar[str] = "sglang"
    connector: Connector | None = BootstrapConnector()
    load_path: str | None = "/v1/loads"
    lora_load_path: ClassVar[str] = "/load_lora_adapter"
    # `custom_logit_processor` is serialized code the engine would run.
    control_fields: ClassVar[frozenset[str]] = BootstrapConnector.control_fields | {
        "routed_dp_rank",
        "rid",
        "custom_logit_processor",
    }
    control_headers: ClassVar[frozenset[str]] = frozenset({"x-data-parallel-rank"})
    control_header_prefixes: ClassVar[tuple[str, ...]] = ("x-sglang-",)

    def tokenizer_hint(self, spec: EngineSpec, model: str) -> str | None:
        return flag_value(spec.extra_args, "--tokenizer-path")

    def lora_model(self, base: str, adapter: str) -> str:
        return f"{base}:{adapter}"  # SGLang's OpenAI API

    def lora_adapter(self, base: str, model: str) -> str | None:
        return None if model == base else model.removeprefix(base + ":")

    def aux_port_names(self, spec: EngineSpec, role: Role) -> tuple[str, ...]:
        names: list[str] = []
        if kv_events_port_needed(spec):
            names.append(KV_EVENTS_PORT)
        if role == "prefill":
            names.append(BOOTSTRAP_PORT)
        return tuple(names)

    def command(
        self, spec: EngineSpec, model: str, slot: ReplicaSlot, served_model_name: str | None = None
    ) -> tuple[list[str], dict[str, str]]:
        if spec.kv_cache_memory_bytes is not None:
            raise ValueError(
                "kv_cache_memory_bytes is not supported by SGLang; use gpu_memory_utilization "
                "(--mem-fraction-static) instead"
            )
        if spec.kv_offload is not None:
            raise ValueError("kv_offload is not supported for SGLang engines (vLLM and the simulator only)")
        argv = [
            *(spec.command or ["python3", "-m", "sglang.launch_server"]),
            "--model-path",
            model,
            "--host",
            slot.host,
            "--port",
            str(slot.port),
        ]
        if served_model_name and served_model_name != model:
            argv += ["--served-model-name", served_model_name]
        if spec.tensor_parallel_size > 1:
            argv += ["--tp-size", str(spec.tensor_parallel_size)]
        if spec.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", _KV_DTYPES[spec.kv_cache_dtype]]
        if not spec.chunked_prefill.enabled:
            argv += ["--chunked-prefill-size", "-1"]
        elif spec.chunked_prefill.max_num_batched_tokens is not None:
            argv += ["--chunked-prefill-size", str(spec.chunked_prefill.max_num_batched_tokens)]
        if not spec.prefix_caching:
            argv.append("--disable-radix-cache")
        page_size = spec.block_size
        if page_size is None and spec.kv_events:
            # SGLang publishes one BlockStored per page, sized page_size (1 by default on CUDA):
            # precise mode hashes 16-token blocks, so the pages must be 16 tokens as well.
            page_size = DEFAULT_KV_EVENTS_PAGE_SIZE
        argv += valued_flags(
            ("--page-size", page_size),
            ("--max-running-requests", spec.max_num_seqs),
            ("--context-length", spec.max_model_len),
        )
        if spec.gpu_memory_utilization is not None or slot.gpu_sharers > 1:
            fraction = spec.gpu_memory_utilization or DEFAULT_MEM_FRACTION_STATIC
            argv += ["--mem-fraction-static", split_fraction(fraction, slot.gpu_sharers)]
        if slot.role != "mixed":
            argv += [
                "--disaggregation-mode",
                slot.role,
                "--disaggregation-transfer-backend",
                spec.pd_transfer_backend,
            ]
            if slot.role == "prefill":
                argv += ["--disaggregation-bootstrap-port", str(slot.aux_ports[BOOTSTRAP_PORT])]
        if spec.kv_events:
            argv += ["--kv-events-config", kv_events_config(slot)]
        if spec.priority_scheduling:
            # Priority scheduling works only with the fcfs or lof policies.
            argv += ["--schedule-policy", "fcfs", "--enable-priority-scheduling"]
        if spec.lora is not None:
            argv += lora_args(spec.lora)
        argv += ["--enable-metrics", "--enable-cache-report", *spec.extra_args]
        return argv, self.gpu_env(slot) | spec.env

    def parse_load(self, body: bytes) -> EngineLoad:
        """Either `/v1/loads` JSON (one entry per data-parallel rank) or `sglang:` metrics."""
        stripped = body.lstrip()
        if stripped[:1] in (b"{", b"["):
            return _parse_loads_json(orjson.loads(stripped))
        series = scan_exposition(body.decode(errors="replace"), _LOAD_SERIES)
        load = EngineLoad(
            running=int(total(series[RUNNING])),
            waiting=int(total(series[WAITING])),
            kv_usage=mean(series[TOKEN_USAGE]),
        )
        if series[MAX_TOKENS]:
            # Capacity in tokens: SGLang pages are one token on CUDA.
            load.num_gpu_blocks, load.block_size = int(total(series[MAX_TOKENS])), 1
        return load

    def engine_priority(self, level: int) -> int:
        # SGLang schedules the highest `priority` value first (unless started with
        # --schedule-low-priority-values-first, which this adapter never emits).
        return level


def lora_args(lora: EngineLora) -> list[str]:
    """SGLang's LoRA flags; its run-time endpoints (/load_lora_adapter) need no switch."""
    args = ["--enable-lora"]
    if lora.modules:
        args += ["--lora-paths", *(f"{m.name}={m.path}" for m in lora.modules)]
    args += valued_flags(
        ("--max-loras-per-batch", lora.max_loras),
        ("--max-lora-rank", lora.max_lora_rank),
        ("--max-loaded-loras", lora.max_cpu_loras),
    )
    return args


def _parse_loads_json(doc: Any) -> EngineLoad:
    if isinstance(doc, dict):
        ranks = doc.get("loads", [doc])
    elif isinstance(doc, list):
        ranks = doc
    else:
        raise ValueError("unexpected /v1/loads body")
    ranks = [r for r in ranks if isinstance(r, dict)]
    if not ranks:
        raise ValueError("no load entries in /v1/loads body")
    load = EngineLoad(
        running=sum(int(r.get("num_running_reqs", 0)) for r in ranks),
        waiting=sum(int(r.get("num_waiting_reqs", 0)) for r in ranks),
        kv_usage=sum(float(r.get("token_usage", 0.0)) for r in ranks) / len(ranks),
    )
    capacity = sum(int(r.get("max_total_num_tokens", 0)) for r in ranks)
    if capacity:
        load.num_gpu_blocks, load.block_size = capacity, 1
    return load
