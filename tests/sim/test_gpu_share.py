"""`--gpu-share N`: replicas sharing one GPU, in real simulator processes on loopback.

Alone in its process a replica gets a static 1/N of the time-sliced GPU, so its steps take N /
efficiency times as long whatever the others do; replicas of one process time-slice a shared device,
so one alone busy runs at full speed and N busy together each take about N / efficiency times as long.
Times are the engines' own (simulated seconds, from /metrics), compared with the cost model's.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.sim.cli import parse_args, replica_options
from gateway.sim.cost_model import CostModel, StepShape
from gateway.sim.profiles import get_profile
from tests.simfleet import metric_values, sim_fleet

PROFILE = get_profile("h200-llama3.1-8b")
COST = CostModel(PROFILE)
SLOWDOWN = 4 / PROFILE.timeslice_efficiency  # four busy replicas on one GPU


def prompt(n: int, seed: int) -> list[int]:
    """n token ids no other prompt of the test starts with: always a cold prefill."""
    return [1000 + seed * 10_000 + i for i in range(n)]


def prefill_step(n: int) -> float:
    """Seconds of one step prefilling a cold n-token prompt alone on a whole GPU."""
    return COST.step_time(StepShape(n, n * n / 2, n, num_seqs=1, prompt_tokens_admitted=n))


def decode_step(ctx: int) -> float:
    return COST.step_time(StepShape(decode_seqs=1, decode_ctx_tokens=ctx, num_seqs=1))


async def complete(c: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> None:
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True}
    r = await c.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


async def timings(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The mean prefill time (scheduled to first token) and inter-token latency, simulated seconds."""
    v = await metric_values(c, url)
    prefill, itl = "vllm:request_prefill_time_seconds", "vllm:inter_token_latency_seconds"
    return {
        "prefill": v[f"{prefill}_sum"] / v[f"{prefill}_count"],
        "itl": v[f"{itl}_sum"] / v[f"{itl}_count"],
    }


async def test_a_lone_replica_gets_a_static_share() -> None:
    n, out = 2000, 9
    for share, slowdown in ((1, 1.0), (4, SLOWDOWN)):
        with sim_fleet("--gpu-share", str(share), profile=PROFILE.name, speedup=20) as fleet:
            async with httpx.AsyncClient() as c:
                await complete(c, fleet.url, prompt(n, 0), out)
                t = await timings(c, fleet.url)
        # The engine's clock advances by exactly the cost model's step times, scaled by the share.
        assert t["prefill"] == pytest.approx(slowdown * prefill_step(n), rel=0.01)
        assert t["itl"] == pytest.approx(slowdown * decode_step(n + out // 2), rel=0.01)


async def test_replicas_of_one_process_time_slice_their_gpu() -> None:
    n, out = 8000, 33
    prefill, decode = prefill_step(n), decode_step(n + out // 2)
    with sim_fleet("--gpu-share", "4", replicas=4, profile=PROFILE.name, speedup=1) as fleet:
        async with httpx.AsyncClient() as c:
            await complete(c, fleet.urls[0], prompt(n, 0), out)
            alone = await timings(c, fleet.urls[0])
            await asyncio.gather(*(complete(c, u, prompt(n, 1 + i), out) for i, u in enumerate(fleet.urls)))
            together = [await timings(c, u) for u in fleet.urls[1:]]
    # Alone on the device, replica 0 ran at the whole GPU's speed (the event loop's lateness on a
    # busy machine only ever adds time).
    assert prefill * 0.99 <= alone["prefill"] < 1.3 * prefill
    assert decode * 0.99 <= alone["itl"] < 1.5 * decode
    # Four prefills at once share the device: each finishes at about four times its time alone, over
    # the time-slicing efficiency (the first to arrive a little sooner), and the decodes that follow
    # share it likewise.
    for t in together:
        assert 0.85 * SLOWDOWN * prefill < t["prefill"] < 1.25 * SLOWDOWN * prefill
        assert 0.75 * SLOWDOWN * decode < t["itl"] < 1.3 * SLOWDOWN * decode


def test_replicas_must_fill_whole_gpus() -> None:
    with pytest.raises(ValueError, match="multiple of --gpu-share"):
        replica_options(parse_args(["m", "--replicas", "6", "--gpu-share", "4"]))
    shared = replica_options(parse_args(["m", "--replicas", "8", "--gpu-share", "4"]))
    assert len({id(o.device) for o in shared}) == 2 and {o.engine.gpu_share for o in shared} == {1}
    (lone,) = replica_options(parse_args(["m", "--gpu-share", "4"]))
    assert lone.device is None and lone.engine.gpu_share == 4
