"""Measured replica speed: fitted from requests' service times, and measured end to end by a real
gateway in front of two simulated replicas of which one runs four times slower."""

from __future__ import annotations

import random

import httpx

from gateway.fleet.replica import Replica
from gateway.fleet.replica_speed import MIN_SAMPLES, ReplicaSpeed
from gateway.policy import relative_prefill_speeds
from tests.conftest import gateway_settings
from tests.policies.helpers import candidates, replicas
from tests.simfleet import sim_fleet

MODEL = "sim-model"


def test_rate_is_tokens_over_service_time_overheads_included() -> None:
    speed = ReplicaSpeed()
    rng = random.Random(0)
    t = 0.0
    sizes = [rng.choice([128, 128, 128, 2176]) for _ in range(200)]
    for uncached in sizes:
        t += 1.0  # one at a time: no queueing
        service = 0.004 + uncached / 20_000
        speed.observe(t, t + service, t + service + 0.1, uncached, 11)
    assert speed.prefill_tokens_per_s is not None
    assert 12_000 < speed.prefill_tokens_per_s < 20_000  # 4 ms per request weighs on 640-token means
    assert speed.decode_tokens_per_s is not None and abs(speed.decode_tokens_per_s - 100) < 1e-6


def test_a_burst_prefilled_in_one_step_counts_the_step_once() -> None:
    """Eight requests sent together and prefilled in one 0.4 s step: seven see their service start
    at the first one's first token (0 s each); the rate stays the step's, not one 8x faster."""
    speed = ReplicaSpeed()
    for burst in range(4):
        sent = 10.0 * burst
        for _ in range(8):
            speed.observe(sent, sent + 0.4, sent + 1.0, 500, 4)
    assert speed.prefill_tokens_per_s is not None
    # Decay weighs the step's first request a little below its seven followers.
    assert 8_000 < speed.prefill_tokens_per_s < 13_000


def test_queued_requests_count_from_the_previous_first_token() -> None:
    """Eight requests sent together: each one's service starts at the previous one's first token, so
    the queue's wait is not taken for slowness."""
    speed = ReplicaSpeed()
    for k in range(MIN_SAMPLES * 2):
        sent = 10.0 * (k // 8)
        first = sent + ((k % 8) + 1) * 1000 / 10_000  # 1,000 tokens each at 10k tokens/s, in turn
        speed.observe(sent, first, first + 0.1, 1000, 1)
    assert speed.prefill_tokens_per_s is not None
    assert abs(speed.prefill_tokens_per_s - 10_000) < 1
    assert speed.decode_tokens_per_s is None  # one output token: no decode figure


def test_no_figure_before_enough_requests() -> None:
    speed = ReplicaSpeed()
    for k in range(MIN_SAMPLES - 1):
        speed.observe(k, k + 0.1, k + 0.2, 1000, 8)
    assert speed.prefill_tokens_per_s is None and speed.decode_tokens_per_s is None


async def test_gateway_measures_a_slow_replica_as_slow(gateway) -> None:
    with (
        sim_fleet("--log-level", "warning", model=MODEL, speedup=1.0) as fast,
        sim_fleet("--log-level", "warning", model=MODEL, speedup=0.25) as slow,
    ):
        endpoints = [{"url": fast.url, "name": "fast"}, {"url": slow.url, "name": "slow"}]
        gw = await gateway(gateway_settings([], pool={"model": MODEL, "endpoints": endpoints}))
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(4 * MIN_SAMPLES):  # round robin: half to each, one at a time
                words = " ".join(f"w{i}x{k}" for k in range(200 + 300 * (i % 5)))
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": words}],
                    "max_tokens": 16,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                resp = await client.post(f"{gw.url}/v1/chat/completions", json=body)
                assert resp.status_code == 200
        replicas = gw.runtime.routers["p"].pool.replicas
        fast_speed, slow_speed = replicas["fast"].speed, replicas["slow"].speed
        assert fast_speed.prefill_tokens_per_s is not None and slow_speed.prefill_tokens_per_s is not None
        assert fast_speed.decode_tokens_per_s is not None and slow_speed.decode_tokens_per_s is not None
        # Four times slower in simulated time; the gateway's own per-request costs blur it a little.
        assert slow_speed.prefill_tokens_per_s < 0.5 * fast_speed.prefill_tokens_per_s
        assert slow_speed.decode_tokens_per_s < 0.5 * fast_speed.decode_tokens_per_s


def test_a_short_prompt_interleaved_with_a_long_one_does_not_shorten_its_service() -> None:
    """A 20k-token document sent at 0 has its first token at 2.0 s; chats sent during its prefill
    got theirs earlier (chunked prefill interleaves them) and are seen first."""
    speed = ReplicaSpeed()
    t = 0.0
    for _ in range(MIN_SAMPLES):
        for k in range(3):
            speed.observe(t + 0.5 + k * 0.5, t + 0.6 + k * 0.5, t + 0.7 + k * 0.5, 1000, 4)
        speed.observe(t, t + 2.0, t + 2.1, 20_000, 4)
        t += 10.0
    assert speed.prefill_tokens_per_s is not None
    # 23,000 tokens in 2.3 s of service: the document's 2.0 s counted whole.
    assert 8_000 < speed.prefill_tokens_per_s < 12_000


def served(replica: Replica, sizes: list[int], pace: float = 1.0) -> None:
    """`replica` prefilled these uncached sizes one at a time, each in 20 ms plus 10k tokens/s,
    divided by its `pace`."""
    for k, uncached in enumerate(sizes):
        t = 10.0 * k
        service = (0.02 + uncached / 10_000) / pace
        replica.speed.observe(t, t + service, t + service + 0.1, uncached, 8)


def test_relative_speeds_compare_requests_of_like_size() -> None:
    """r0 served documents among its chats, r1 only chats, both at one pace: per-request overheads
    make r0's overall rate read 1.7x r1's, but alike sizes compare alike. r2 is twice as fast on
    every size, r3 not measured yet."""
    reps = replicas(4)
    served(reps[0], [256, 256, 256, 12_000] * 4)
    served(reps[1], [256] * 16)
    served(reps[2], [256] * 16, pace=2.0)
    rate0, rate1 = reps[0].speed.prefill_tokens_per_s, reps[1].speed.prefill_tokens_per_s
    assert rate0 is not None and rate1 is not None and rate0 > 1.6 * rate1
    r0, r1, r2, r3 = relative_prefill_speeds(candidates(reps))
    assert r0 is not None and r1 is not None and r2 is not None and r3 is None
    # Within 10% (not 1.7x): the 12k-token class is r0's alone, so it counts 1.0 there.
    assert abs(r0 - r1) < 0.1 * r1
    assert abs(r2 / r1 - 2.0) < 1e-9


def test_requests_queued_behind_another_prefill_are_left_out_of_the_size_classes() -> None:
    """Chats sent while a 24k-token document prefills get their first tokens in its last step
    (service ~0 each): the step's time is the document's class's, so counted there the chats'
    class read many times the pool's pace and drew every request (routing-long, seed 5)."""
    reps = replicas(2)
    t = 0.0
    for _ in range(4):
        reps[0].speed.observe(t, t + 3.0, t + 3.5, 24_000, 8)  # the document, alone
        for k in range(8):  # chats queued behind it, all prefilled in its last step
            reps[0].speed.observe(t + 0.5 + 0.1 * k, t + 3.01, t + 3.6, 512, 8)
        t += 10.0
        reps[0].speed.observe(t, t + 0.08, t + 0.5, 512, 8)  # a chat on an idle replica
        t += 1.0
    for k in range(40):  # the other replica serves chats alone, at the same pace
        reps[1].speed.observe(100.0 + k, 100.08 + k, 100.5 + k, 512, 8)
    assert sum(v[2] for v in reps[0].speed.by_size.values()) < 8  # the queued 32 are not there
    r0, r1 = relative_prefill_speeds(candidates(reps))
    assert r0 is not None and r1 is not None and abs(r0 - r1) < 0.05


def test_relative_speeds_ignore_lone_samples_and_are_bounded() -> None:
    reps = replicas(3)
    served(reps[0], [256] * 16)
    served(reps[1], [256] * 16)
    served(reps[2], [256] * 16, pace=50.0)  # 50x the others on one class: held to 4x the pool
    reps[0].speed.observe(500.0, 500.01, 500.1, 20_000, 8)  # one document 50x fast: a lone sample
    r0, r1, r2 = relative_prefill_speeds(candidates(reps))
    assert r0 is not None and r1 is not None and r2 is not None
    assert abs(r0 - r1) < 0.05 * r1
    assert r2 == 4.0
