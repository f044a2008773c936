"""A decode replica's KV link, in a real simulator process: transfers in flight share it.

vLLM posts the NIXL read of every decode leg it has allocated blocks for, and UCX moves them
together, so two transfers that start together both end at about twice the time one takes alone
(processor sharing); a link that carried them one after the other would finish the first in its
lone time. Times are the engine's own (simulated seconds, vLLM's `vllm:nixl_xfer_time_seconds`),
compared with the cost model's.
"""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.sim.cost_model import CostModel
from gateway.sim.profiles import get_profile
from tests.simfleet import metric_values, sim_fleet

BW = 4e8  # bytes/s: the H200 run's link (results/gpu/2026-12-02-pd)
PROFILE = get_profile("tiny", transfer_bw=BW)
CONSUMER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
N = 2048  # prompt tokens, all of them moved


def prompt(seed: int) -> list[int]:
    """N token ids no other prompt of the test starts with: nothing of it is cached on the decode side."""
    return [1000 + seed * 10_000 + i for i in range(N)]


async def decode_legs(c: httpx.AsyncClient, url: str, *seeds: int) -> None:
    """One batched completion whose prompts are all decode legs: the engine gets them at one instant.
    The parameters name no prefill replica, so the simulator takes the blocks as sent."""
    body = {
        "model": "m",
        "prompt": [prompt(s) for s in seeds],
        "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3]},
    }
    r = await c.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


async def transfer_seconds(c: httpx.AsyncClient, url: str) -> tuple[float, int]:
    """The sum and count of the replica's KV transfer times."""
    v = await metric_values(c, url)
    return v["vllm:nixl_xfer_time_seconds_sum"], int(v["vllm:nixl_xfer_time_seconds_count"])


async def test_transfers_in_flight_share_the_decode_replicas_link() -> None:
    lone = CostModel(PROFILE, "fp8").transfer_time(N)
    args = ("--kv-transfer-config", CONSUMER, "--kv-transfer-bw", str(BW), "--kv-cache-dtype", "fp8")
    with sim_fleet(*args, speedup=20) as fleet:
        async with httpx.AsyncClient() as c:
            await decode_legs(c, fleet.url, 0)
            alone, count = await transfer_seconds(c, fleet.url)
            assert count == 1 and alone == pytest.approx(lone, rel=0.01)
            await decode_legs(c, fleet.url, 1, 2)
            total, count = await transfer_seconds(c, fleet.url)
    assert count == 3
    # Both took about twice the lone time (4 lone times together); one after the other they would
    # have taken 1 and 2 (3 together).
    assert total - alone == pytest.approx(4 * lone, rel=0.02)
