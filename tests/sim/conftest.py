"""Simulator test helpers: in-process replicas on ephemeral loopback ports, and virtual-clock engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.sim.cli import parse_args, replica_options
from gateway.sim.engine import Engine, EngineConfig
from gateway.sim.profiles import get_profile
from gateway.sim.server import Replica, ReplicaOptions
from tests.simfleet import sim_process

MODEL = "sim-model"


def engine(profile: str = "h200-llama3.1-8b", **kw: Any) -> Engine:
    return Engine(EngineConfig(get_profile(profile), **kw))


@asynccontextmanager
async def replica(
    profile: str = "tiny", speedup: float = 50.0, engine_kw: dict[str, Any] | None = None, **kw: Any
) -> AsyncIterator[Replica]:
    opts = ReplicaOptions(
        engine=EngineConfig(get_profile(profile), **(engine_kw or {})),
        model=MODEL,
        served_model_names=[MODEL],
        port=0,
        speedup=speedup,
        single_process_replica=False,
        **kw,
    )
    r = Replica(opts)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


def url(r: Replica) -> str:
    return f"http://127.0.0.1:{r.port}"


async def state(client: httpx.AsyncClient, r: Replica) -> dict[str, Any]:
    return (await client.get(f"{url(r)}/sim/state")).json()


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2, "maxLength": 40},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
                "hours": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="session")
def strict_sim() -> Iterator[str]:
    """A simulator process as a tool-calling, LoRA-serving vLLM would be started (runtime LoRA updates on)."""
    args = (
        "--enable-lora", "--max-loras", "1", "--lora-modules", "sql=/adapters/sql",
        '{"name": "chat", "path": "/adapters/chat", "base_model_name": "m"}',
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "4096",
    )  # fmt: skip
    with sim_process(*args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as url:
        yield url


@asynccontextmanager
async def cli_replica(*argv: str) -> AsyncIterator[str]:
    """An in-process replica built from a `vllm serve` command line, on an ephemeral loopback port."""
    (opts,) = replica_options(parse_args(["m", "--port", "0", "--profile", "tiny", "--speedup", "50", *argv]))
    opts.single_process_replica = False
    r = Replica(opts)
    await r.start()
    try:
        yield url(r)
    finally:
        await r.stop()
