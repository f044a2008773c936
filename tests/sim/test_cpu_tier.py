"""The simulator's CPU KV tier (vLLM's OffloadingConnector, native backend): write-through of prompt
blocks, loads past the GPU hit, LRU eviction, and the placeholder KV events vLLM 0.26 publishes."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import zmq
import zmq.asyncio

from gateway.sim.kv_cache import block_hashes
from gateway.sim.kv_events import encode_events
from tests.sim.conftest import MODEL, engine, replica, url
from tests.sim.test_engine import prompt, run_one

BS = 16
GIB = 1 << 30


def tiered(gpu_blocks: int, cpu_blocks: int) -> object:
    e = engine(num_gpu_blocks=gpu_blocks, kv_offloading_size=cpu_blocks * BS * 131072 / GIB)
    assert e.cpu is not None and e.cpu.num_blocks == cpu_blocks  # llama-3.1-8b bf16: 128 KiB a token
    return e


def test_a_prefix_evicted_from_the_gpu_is_loaded_from_cpu_faster_than_recomputed() -> None:
    e = tiered(gpu_blocks=400, cpu_blocks=2000)
    first = prompt(4800, 1)  # 300 blocks
    cold = run_one(e, first)
    warm = run_one(e, first + prompt(40, 8))  # from the GPU
    for seed in (2, 3):  # 600 blocks of other prompts push `first` out of the 400 GPU blocks
        run_one(e, prompt(4800, seed))
    assert e.pool.match_prefix(block_hashes(first, BS)) == []
    again = run_one(e, first + prompt(40, 9))
    assert again.num_cached == 4800  # all of it, from CPU
    assert e.metrics.external_prefix_cache_hits == 4800
    assert warm.ttft < again.ttft < cold.ttft / 3  # type: ignore[operator]


def test_without_a_cpu_tier_the_evicted_prefix_is_recomputed() -> None:
    e = engine(num_gpu_blocks=200)
    assert e.cpu is None
    first = prompt(1600, 1)
    run_one(e, first)
    for seed in (2, 3, 4):
        run_one(e, prompt(1600, seed))
    assert run_one(e, first + prompt(40, 9)).num_cached == 0


def test_cpu_lru_evicts_the_least_recently_used_and_says_so() -> None:
    e = tiered(gpu_blocks=400, cpu_blocks=150)
    e.cpu.record_events = True  # type: ignore[attr-defined]
    a, b = prompt(1600, 1), prompt(1600, 2)  # 100 blocks each: b pushes 50 of a's out of the CPU tier
    run_one(e, a)
    run_one(e, b)
    events = e.cpu.take_events()  # type: ignore[attr-defined]
    stored = [h for kind, h in events if kind == "cpu_stored"]
    removed = [h for kind, hs in events if kind == "cpu_removed" for h in hs]  # type: ignore[union-attr]
    assert stored == block_hashes(a, BS) + block_hashes(b, BS)
    assert removed == block_hashes(a, BS)[:50]  # a's oldest-stored blocks, its head, went first
    wire = encode_events([*events[:1], ("cpu_removed", removed[:2])], BS)
    assert (
        wire
        == [
            ["BlockStored", [stored[0]], None, [], 0, None, "CPU"],  # vLLM's placeholder payload
            ["BlockRemoved", removed[:2], "CPU"],
        ]
    )


def test_generated_blocks_are_not_offloaded() -> None:
    e = tiered(gpu_blocks=400, cpu_blocks=400)
    run_one(e, prompt(160, 1), max_tokens=64)  # 10 prompt blocks, 4 blocks of output
    assert e.cpu.num_cached == 10  # type: ignore[attr-defined]


async def test_cpu_events_follow_gpu_events_over_zmq_and_metrics_report_the_tier() -> None:
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}
    kw = {"num_gpu_blocks": 64, "kv_offloading_size": 0.25}
    async with replica(kv_events=cfg, engine_kw=kw) as r, httpx.AsyncClient() as c:
        sub.connect(r.kv_pub.endpoint)  # type: ignore[union-attr]
        probes = iter(range(1, 10_000))
        events: list[list[object]] = []
        while not any(ev[0] == "BlockStored" and ev[-1] == "CPU" for ev in events):  # slow joiner: probe
            ids = [next(probes)] * 32
            await c.post(f"{url(r)}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
            try:
                _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 0.2)
            except TimeoutError:
                continue
            events = msgpack.unpackb(payload)[1]
        gpu = next(ev for ev in events if ev[0] == "BlockStored" and ev[6] == "GPU")
        cpu = [ev for ev in events if ev[0] == "BlockStored" and ev[6] == "CPU"]
        assert events.index(gpu) < events.index(cpu[0])
        assert [ev[1][0] for ev in cpu] == gpu[1]  # the same block hashes, one placeholder each
        text = (await c.get(f"{url(r)}/metrics")).text
        # As vLLM's: the CPU tier is reset only with reset_external=true.
        assert (await c.post(f"{url(r)}/reset_prefix_cache")).json() == {"success": True}
        assert r.engine.cpu.num_cached > 0  # type: ignore[union-attr]
        await c.post(f"{url(r)}/reset_prefix_cache", params={"reset_external": "true"})
        assert r.engine.cpu.num_cached == 0  # type: ignore[union-attr]
    sub.close(0)
    assert 'kv_offloading_size="0.25"' in text and 'kv_offloading_backend="native"' in text
    assert "vllm:external_prefix_cache_hits_total" in text
