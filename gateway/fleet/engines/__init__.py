"""Engine adapters, one module per engine kind, looked up by kind with `get_adapter`."""

from __future__ import annotations

from gateway.config import EngineSpec
from gateway.fleet.engines.base import EngineAdapter, ReplicaSlot
from gateway.fleet.engines.sglang import SGLangAdapter
from gateway.fleet.engines.sim import SimAdapter, sim_api
from gateway.fleet.engines.vllm import VLLMAdapter

_ADAPTERS: dict[str, EngineAdapter] = {
    "vllm": VLLMAdapter(),
    "sglang": SGLangAdapter(),
    "sim": SimAdapter(),
}
_SIM_SGLANG = SimAdapter("sglang")


def get_adapter(kind: str) -> EngineAdapter:
    """The adapter for an engine kind (`vllm`, `sglang`, `sim`); KeyError names the known kinds."""
    try:
        return _ADAPTERS[kind]
    except KeyError:
        raise KeyError(f"unknown engine kind {kind!r}; known: {sorted(_ADAPTERS)}") from None


def adapter_for_spec(spec: EngineSpec) -> EngineAdapter:
    """Like `get_adapter(spec.kind)`, but a simulator told `--api sglang` is read the SGLang way."""
    if spec.kind == "sim" and sim_api(spec) == "sglang":
        return _SIM_SGLANG
    return get_adapter(spec.kind)


__all__ = [
    "EngineAdapter",
    "ReplicaSlot",
    "SGLangAdapter",
    "SimAdapter",
    "VLLMAdapter",
    "adapter_for_spec",
    "get_adapter",
]
