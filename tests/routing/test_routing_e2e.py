"""prefix_affinity end to end: a real gateway in front of a real simulated fleet (separate process).

Requests sharing a system prompt stay on the replica that holds it while it has room, then the hot
prefix spills onto another replica, which from then on serves it from its own cache too. Checked on
the gateway's x-kvgate-replica header and on the engine's cached_tokens in usage.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest

from tests.conftest import gateway_settings
from tests.simfleet import sim_fleet

MODEL = "sim-model"
SYSTEM = "You are the support assistant of a company that sells garden tools. " * 120  # ~1700 tokens
# ~300 tokens each: a burst of them queues more prefill work than recomputing the system prompt.
QUESTION = "Which rake, hoe or spade suits clay soil, and how should it be cleaned after use? " * 16


@dataclass
class Answer:
    replica: str
    cached_tokens: int
    prompt_tokens: int


@pytest.fixture
def three_replicas() -> Iterator[list[str]]:
    """Three simulated replicas in one process."""
    with sim_fleet("--log-level", "warning", replicas=3, model=MODEL, speedup=0.25) as fleet:
        yield fleet.urls


async def ask(client: httpx.AsyncClient, url: str, question: str) -> Answer:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        replica = resp.headers["x-kvgate-replica"]
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                usage = chunk.get("usage") or usage
    assert usage is not None
    return Answer(replica, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"])


async def test_shared_prompt_sticks_then_spills_to_a_second_replica(three_replicas, gateway) -> None:
    endpoints = [{"url": u, "name": f"r{i}", "kind": "sim"} for i, u in enumerate(three_replicas)]
    # The tiny profile prefills about 45k tokens/s (gateway.sim.cost_model); the fleet runs in slow
    # motion (speedup 0.25) so that a burst from the test client outruns a replica's prefill.
    policy = {"type": "prefix_affinity", "args": {"prefill_tokens_per_s": 45_000 * 0.25}}
    pool = {"model": MODEL, "endpoints": endpoints, "policy": policy}
    gw = await gateway(gateway_settings([], pool=pool))
    async with httpx.AsyncClient(timeout=30) as client:
        # One at a time: every request lands where the prompt is warm, and hits its cache.
        serial = [await ask(client, gw.url, f"Question {i}: how do I sharpen shears?") for i in range(4)]
        home = serial[0].replica
        assert [a.replica for a in serial] == [home] * 4
        assert serial[0].cached_tokens == 0
        assert all(a.cached_tokens >= 0.8 * a.prompt_tokens for a in serial[1:])

        # A burst: the home replica takes requests until the prefill work queued there outweighs a
        # recompute, then the prefix spills; the spilled request pays the full prefill there.
        burst = await asyncio.gather(*(ask(client, gw.url, f"Burst {i}: {QUESTION}") for i in range(24)))
        counts = Counter(a.replica for a in burst)
        assert counts.most_common(1)[0][0] == home, counts
        assert 3 <= counts[home] < 24, counts
        spilled = {r for r in counts if r != home}
        assert spilled, counts
        assert all(a.cached_tokens > 0 for a in burst if a.replica == home)

        # Another burst: the prefix is now warm on more than one replica, and each serves it cached.
        again = await asyncio.gather(*(ask(client, gw.url, f"Again {i}: {QUESTION}") for i in range(24)))
        warm_replicas = {a.replica for a in again if a.cached_tokens >= 0.8 * a.prompt_tokens}
        assert home in warm_replicas and warm_replicas & spilled, Counter(a.replica for a in again)
