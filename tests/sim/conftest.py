"""Simulator test helpers: in-process replicas on ephemeral loopback ports, and virtual-clock engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from gateway.sim.engine import Engine, EngineConfig
from gateway.sim.profiles import get_profile
from gateway.sim.server import Replica, ReplicaOptions

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


async def wait_for(cond: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def state(client: httpx.AsyncClient, r: Replica) -> dict[str, Any]:
    return (await client.get(f"{url(r)}/sim/state")).json()
