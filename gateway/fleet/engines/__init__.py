"""Engine adapters, one module per engine kind, looked up by kind with `get_adapter`; each kind's
prefill/decode connector in a module of its own (`nixl`, `bootstrap`)."""

from __future__ import annotations

from gateway.config import EngineSpec
from gateway.fleet.engines.base import EngineAdapter, ReplicaSlot
from gateway.fleet.engines.connector import Connector, DecodeLeg
from gateway.fleet.engines.openai import OpenAIAdapter
from gateway.fleet.engines.sglang import SGLangAdapter
from gateway.fleet.engines.sim import SimAdapter, sim_api
from gateway.fleet.engines.vllm import VLLMAdapter

_ADAPTERS: dict[str, EngineAdapter] = {
    "vllm": VLLMAdapter(),
    "sglang": SGLangAdapter(),
    "sim": SimAdapter(),
    "openai": OpenAIAdapter(),
}
_SIM_SGLANG = SimAdapter("sglang")

# What steers any engine kind: a client may send none of it, whatever engine serves it.
CONTROL_FIELDS = frozenset().union(*(a.control_fields for a in _ADAPTERS.values()))
CONTROL_HEADERS = frozenset().union(*(a.control_headers for a in _ADAPTERS.values()))
CONTROL_HEADER_PREFIXES = tuple(
    dict.fromkeys(p for a in _ADAPTERS.values() for p in a.control_header_prefixes)
)


def get_adapter(kind: str) -> EngineAdapter:
    """The adapter for an engine kind (`vllm`, `sglang`, `sim`, `openai`); KeyError names the known kinds."""
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
    "CONTROL_FIELDS",
    "CONTROL_HEADERS",
    "CONTROL_HEADER_PREFIXES",
    "Connector",
    "DecodeLeg",
    "EngineAdapter",
    "OpenAIAdapter",
    "ReplicaSlot",
    "SGLangAdapter",
    "SimAdapter",
    "VLLMAdapter",
    "adapter_for_spec",
    "get_adapter",
]
