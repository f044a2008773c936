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


def test_cpu_lru_evicts_a_stored_prompt_in_its_set_order_and_says_so() -> None:
    e = tiered(gpu_blocks=400, cpu_blocks=150)
    e.cpu.record_events = True  # type: ignore[attr-defined]
    a, b = prompt(1600, 1), prompt(1600, 2)  # 100 blocks each: b pushes 50 of a's out of the CPU tier
    run_one(e, a)
    run_one(e, b)
    events = e.cpu.take_events()  # type: ignore[attr-defined]
    stored = [h for kind, h in events if kind == "cpu_stored"]
    removed = [h for kind, hs in events if kind == "cpu_removed" for h in hs]  # type: ignore[union-attr]
    ha = block_hashes(a, BS)
    # One store job per prompt (each prefilled in one step); vLLM marks a job's blocks evictable in
    # the order of a set of their keys, the simulator in hash order: not the prompt's order.
    assert stored == sorted(ha) + sorted(block_hashes(b, BS))
    assert removed == sorted(ha)[:50]
    # A prompt partly evicted that way matches on CPU only up to its first hole.
    first_hole = min(ha.index(h) for h in removed)
    assert e.cpu.lookup(ha, 0, len(ha)) == first_hole < 50  # type: ignore[attr-defined]
    wire = encode_events([*events[:1], ("cpu_removed", removed[:2])], BS)
    placeholder = {"block_hashes": [stored[0]], "parent_block_hash": None, "token_ids": [], "block_size": 0}
    assert wire == [
        {
            "type": "BlockStored",
            **placeholder,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
            "group_idx": 0,
        },
        {"type": "BlockRemoved", "block_hashes": removed[:2], "medium": "CPU", "group_idx": 0},
    ]


def test_a_request_served_from_the_gpu_stores_again_what_the_cpu_tier_lost() -> None:
    e = tiered(gpu_blocks=400, cpu_blocks=150)
    a, b = prompt(1600, 1), prompt(1600, 2)
    run_one(e, a)
    run_one(e, b)  # 50 of a's blocks leave the CPU tier; all of a stays on the GPU
    ha = block_hashes(a, BS)
    assert e.cpu.lookup(ha, 0, len(ha)) < 50  # type: ignore[attr-defined]
    again = run_one(e, a + prompt(40, 9))
    assert again.num_cached == 1600 and e.metrics.external_prefix_cache_hits == 0  # all from the GPU
    # It loaded nothing from CPU, so vLLM's store cursor started at block 0: the lost blocks are back.
    assert e.cpu.lookup(ha, 0, len(ha)) == len(ha)  # type: ignore[attr-defined]


def test_a_lookup_touches_the_gpu_hit_on_cpu_so_an_idle_prefix_is_evicted_first() -> None:
    e = tiered(gpu_blocks=400, cpu_blocks=200)
    a, b = prompt(1600, 1), prompt(1600, 2)
    run_one(e, a)
    run_one(e, b)  # the CPU tier holds a (least recent) and b
    run_one(e, a + prompt(48, 9))  # a from the GPU; its 3 new blocks evict b's, not a's
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert e.cpu.lookup(ha, 0, len(ha)) == len(ha)  # type: ignore[attr-defined]
    assert e.cpu.num_cached == 200 and e.cpu.lookup(hb, 0, len(hb)) < len(hb)  # type: ignore[attr-defined]


def test_the_cpu_tier_adds_only_its_size_beyond_the_gpus_to_what_a_replica_holds() -> None:
    # Ten 100-block prefixes in turn on 400 GPU blocks and 500 CPU blocks: the
    # CPU tier holds the GPU's prefixes too (write-through, touched on every lookup), so a replica
    # holds five of them, not nine (four on both tiers, one on CPU alone).
    e = tiered(gpu_blocks=400, cpu_blocks=500)
    prefixes = [prompt(1600, s) for s in range(10)]
    for p in prefixes:
        run_one(e, p)
    held = [p for p in prefixes if e.cpu.lookup(block_hashes(p, BS), 0, 100) == 100]  # type: ignore[attr-defined]
    on_gpu = [p for p in prefixes if len(e.pool.match_prefix(block_hashes(p, BS))) == 100]
    assert len(held) == 5 and len(on_gpu) == 4 and all(p in held for p in on_gpu)
    assert e.cpu.stores == 1000 and e.cpu.loads == 0  # type: ignore[attr-defined]


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
        while not any(ev["type"] == "BlockStored" and ev["medium"] == "CPU" for ev in events):  # slow joiner
            ids = [next(probes)] * 32
            await c.post(f"{url(r)}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
            try:
                _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 0.2)
            except TimeoutError:
                continue
            events = msgpack.unpackb(payload)[1]
        gpu = next(ev for ev in events if ev["type"] == "BlockStored" and ev["medium"] == "GPU")
        cpu = [ev for ev in events if ev["type"] == "BlockStored" and ev["medium"] == "CPU"]
        assert events.index(gpu) < events.index(cpu[0])
        # The same block hashes, one placeholder each.
        assert sorted(ev["block_hashes"][0] for ev in cpu) == sorted(gpu["block_hashes"])
        text = (await c.get(f"{url(r)}/metrics")).text
        # As vLLM's: the CPU tier is reset only with reset_external=true.
        assert (await c.post(f"{url(r)}/reset_prefix_cache")).json() == {"success": True}
        assert r.engine.cpu.num_cached > 0  # type: ignore[union-attr]
        await c.post(f"{url(r)}/reset_prefix_cache", params={"reset_external": "true"})
        assert r.engine.cpu.num_cached == 0  # type: ignore[union-attr]
    sub.close(0)
    assert 'kv_offloading_size="0.25"' in text and 'kv_offloading_backend="native"' in text
    assert "vllm:external_prefix_cache_hits_total" in text
    assert "vllm:kv_offload_store_bytes_total" in text and "vllm:kv_offload_load_size_count" in text
    # vLLM's gauge counts blocks pinned by transfers in flight, not what the tier holds.
    assert 'vllm:kv_offload_cpu_cache_usage_perc{engine="0"' in text
