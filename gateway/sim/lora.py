"""LoRA adapters: vLLM's flags and admin endpoints' semantics, and where adapter weights live.

Flags as `vllm serve` takes them: `--enable-lora`, `--lora-modules name=path` or the JSON form
`{"name": ..., "path": ..., "base_model_name": ...}` (several, space separated), `--max-loras` (1),
`--max-lora-rank` (16), `--max-cpu-loras` (defaults to --max-loras). `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` exist only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, as in vLLM.

Cost model (vLLM's worker-side adapter manager, roughly): adapter weights sit in two LRU tiers, the GPU
slots (`--max-loras`, the adapters a batch can use) and a CPU cache (`--max-cpu-loras`). The scheduler
admits a waiting request only if its adapter is already in the running batch or the batch uses fewer than
`--max-loras` adapters (vLLM V1 skips it and scans on). A step whose batch uses an adapter that is not in a
GPU slot pays a swap-in before its forward pass (the LRU adapter not used by the batch is evicted), plus a
read from disk when the adapter is not in the CPU cache either; a dynamic load pays the disk read at load
time, stalling the engine for it (vLLM runs `add_lora` between steps). Sizes and times are a formula, not
a measurement: a rank-r adapter on every linear layer of a model with hidden size h (MLP 3.5 h) holds
20 * r * h bf16 values per layer (84 MB for Llama-3.1-8B at rank 16, split over TP ranks); swap-in = 0.2 ms +
bytes / 25 GB/s (pinned host to device), disk read = 20 ms + bytes / 2 GB/s. The LoRA kernels' extra step
time is not modelled.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.sim.profiles import ModelShape

SWAP_T0_S = 0.2e-3
SWAP_BW = 25e9
LOAD_T0_S = 20e-3
LOAD_BW = 2e9
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Iterable[str]) -> list[LoraModule]:
    """vLLM's LoRAParserAction: `name=path`, or a JSON object with name, path and base_model_name."""
    out: list[LoraModule] = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, _, path = item.partition("=")
            out.append(LoraModule(name, path))
            continue
        try:
            raw = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        try:
            out.append(LoraModule(**raw))
        except TypeError as exc:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {exc}") from None
    return out


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def adapter_bytes(model: ModelShape, rank: int) -> int:
    hidden = model.heads * model.head_dim
    return 2 * 20 * rank * hidden * model.layers


@dataclass(slots=True)
class LoraConfig:
    enabled: bool = False
    modules: list[LoraModule] = field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    runtime_updating: bool = False


class AdapterSlots:
    """The GPU slots and the CPU cache of adapter weights, both LRU, and what moving adapters costs."""

    def __init__(self, cfg: LoraConfig, model: ModelShape, tp: int) -> None:
        self.max_loras = cfg.max_loras
        self.max_cpu = max(cfg.max_cpu_loras or cfg.max_loras, cfg.max_loras)
        size = adapter_bytes(model, cfg.max_lora_rank) / max(tp, 1)  # each GPU holds its shard
        self.swap_s = SWAP_T0_S + size / SWAP_BW
        self.load_s = LOAD_T0_S + size / LOAD_BW
        self.gpu: OrderedDict[str, None] = OrderedDict()
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.swaps = 0
        self.disk_loads = 0

    def _to_cpu(self, name: str) -> float:
        if name in self.cpu:
            self.cpu.move_to_end(name)
            return 0.0
        self.cpu[name] = None
        while len(self.cpu) > self.max_cpu:
            self.cpu.popitem(last=False)
        self.disk_loads += 1
        return self.load_s

    def load(self, name: str) -> float:
        """A (static or dynamic) load: read into the CPU cache. Returns the seconds it takes."""
        return self._to_cpu(name)

    def remove(self, name: str) -> None:
        self.gpu.pop(name, None)
        self.cpu.pop(name, None)

    def activate(self, names: Iterable[str]) -> float:
        """Make a batch's adapters GPU-resident; returns the seconds spent swapping them in."""
        names = set(names)
        cost = 0.0
        for name in names:
            if name in self.gpu:
                self.gpu.move_to_end(name)
                continue
            cost += self._to_cpu(name) + self.swap_s
            self.swaps += 1
            self.gpu[name] = None
            for victim in list(self.gpu):
                if len(self.gpu) <= self.max_loras:
                    break
                if victim not in names:
                    del self.gpu[victim]
        return cost
