"""--shared-gpu: replicas of one simulator process time-slice one device, as engines sharing a GPU do."""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.sim.engine import SharedGpu
from tests.simfleet import sim_fleet

MODEL = "m"


def test_steps_wait_for_the_device() -> None:
    gpu = SharedGpu()
    assert gpu.reserve(1.0, 0.5) == 1.5
    assert gpu.reserve(1.2, 0.5) == 2.0  # asked while busy: starts when the first step ends
    assert gpu.reserve(3.0, 0.1) == 3.1  # idle device: starts at once


async def ttft(client: httpx.AsyncClient, url: str, tag: str) -> float:
    words = " ".join(f"{tag}{k}" for k in range(3000))
    body = {"model": MODEL, "prompt": words, "max_tokens": 1, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise AssertionError("no token")


async def prefill_times(shared: bool) -> tuple[float, float]:
    """(one prompt alone, the slower of two sent together to two replicas)."""
    args = ["--log-level", "warning", *(["--shared-gpu"] if shared else [])]
    # Slow motion: a 3,000-token prefill on the tiny profile takes ~0.6 s of wall clock.
    with sim_fleet(*args, replicas=2, model=MODEL, speedup=0.1) as fleet:
        async with httpx.AsyncClient(timeout=30) as client:
            alone = await ttft(client, fleet.urls[0], "a")
            both = await asyncio.gather(ttft(client, fleet.urls[0], "b"), ttft(client, fleet.urls[1], "c"))
    return alone, max(both)


async def test_two_replicas_on_one_gpu_prefill_in_turn() -> None:
    alone, together = await prefill_times(shared=True)
    assert together > 1.6 * alone
    alone, together = await prefill_times(shared=False)
    assert together < 1.4 * alone
