"""The engine core's modelled effects, on the virtual clock (deterministic, no HTTP)."""

from __future__ import annotations

import itertools
import random
from statistics import median

import pytest

from gateway.sim.cost_model import CostModel, StepShape
from gateway.sim.engine import Engine, Request, run_collecting_gaps
from gateway.sim.kv_cache import block_hashes
from gateway.sim.profiles import get_profile
from tests.sim.conftest import engine

BS = 16


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100_000) for _ in range(n)]


def run_one(e: Engine, ids: list[int], max_tokens: int = 1, **kw: object) -> Request:
    r = Request(f"r{e.steps}-{len(ids)}", ids, max_tokens, block_size=e.block_size, **kw)  # type: ignore[arg-type]
    e.add_request(r)
    e.run_until_idle()
    return r


def test_ttft_grows_linearly_with_uncached_prompt_tokens() -> None:
    e = engine()
    t = {n: run_one(e, prompt(n, n)).ttft for n in (1024, 2048, 3072, 4096)}
    slopes = [(t[b] - t[a]) / 1024 for a, b in ((1024, 2048), (2048, 3072), (3072, 4096))]  # type: ignore[operator]
    assert all(20e-6 < s < 32e-6 for s in slopes), slopes  # ~26.5 us/token as measured
    assert max(slopes) / min(slopes) < 1.15  # linear apart from the small attention term


def test_repeated_prefix_reports_its_full_blocks_as_cached() -> None:
    e = engine()
    base = prompt(1000, 1)
    first = run_one(e, base)
    again = run_one(e, base[:1000] + prompt(50, 2))
    assert first.num_cached == 0
    assert again.num_cached == 1000 // BS * BS
    assert again.ttft < first.ttft / 2  # type: ignore[operator]
    salted = run_one(e, base, cache_salt="tenant-b")
    assert salted.num_cached == 0  # the salt isolates the whole chain


def test_a_block_is_a_hit_only_after_its_prefill_finished() -> None:
    e = engine()
    ids = prompt(2000, 3)
    a, b = (Request(x, ids, 1, block_size=BS) for x in "ab")
    e.add_request(a)
    e.add_request(b)  # same step: a's blocks are still being computed
    e.run_until_idle()
    assert (a.num_cached, b.num_cached) == (0, 0)
    assert run_one(e, ids).num_cached == (2000 - 1) // BS * BS


def _hit_rate_cycling(num_prefixes: int) -> float:
    e = engine("tiny", num_gpu_blocks=200)  # 3,200 tokens of KV
    prefixes = [prompt(512, 100 + i) for i in range(num_prefixes)]  # 32 blocks each
    for _round in range(4):
        for i, p in enumerate(prefixes):
            run_one(e, p + prompt(8, i))
    m = e.metrics
    return m.prefix_cache_hits / m.prefix_cache_queries


def test_working_set_above_capacity_thrashes_below_it_does_not() -> None:
    assert _hit_rate_cycling(4) > 0.7  # 128 blocks fit: every round after the first hits
    assert _hit_rate_cycling(10) < 0.1  # 320 blocks: LRU evicts each prefix before it comes back


def test_fp8_doubles_num_gpu_blocks() -> None:
    p = get_profile("h200-llama3.1-8b")
    bf16 = CostModel(p, "auto").num_gpu_blocks(16, 0.85)
    fp8 = CostModel(p, "fp8").num_gpu_blocks(16, 0.85)
    assert abs(fp8 - 2 * bf16) <= 1
    assert engine(kv_cache_dtype="fp8_e4m3", gpu_memory_utilization=0.85).pool.num_blocks == fp8


def _median_gap(batch: int, prompt_len: int, kv_cache_dtype: str = "auto") -> float:
    e = engine(kv_cache_dtype=kv_cache_dtype)
    gaps = run_collecting_gaps(
        e, [Request(f"d{i}", prompt(prompt_len, i), 32, block_size=BS) for i in range(batch)]
    )
    return median(gaps)


def test_decode_step_time_grows_with_batch_and_context() -> None:
    small = _median_gap(1, 512)
    batched = _median_gap(128, 512)
    long_ctx = _median_gap(128, 2048)
    assert small < batched < long_ctx
    assert _median_gap(128, 2048, "fp8") < long_ctx  # FP8 halves the KV bytes read


def _max_decode_stall(chunked: bool) -> float:
    e = engine(
        max_model_len=40_000,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=2048 if chunked else 40_000,
    )
    times: list[float] = []

    def on_output(outs: list[Request]) -> None:
        if any(r.id == "dec" for r in outs):
            times.append(e.now)

    e.on_output = on_output
    e.add_request(Request("dec", prompt(100, 1), 400, block_size=BS))
    e.advance_to(0.1)
    e.add_request(Request("long", prompt(30_000, 2), 1, block_size=BS))
    e.run_until_idle()
    return max(b - a for a, b in itertools.pairwise(times))


def test_chunked_prefill_bounds_the_decode_stall_of_a_long_prompt() -> None:
    chunked, whole = _max_decode_stall(True), _max_decode_stall(False)
    assert whole > 0.5  # the 30k prefill runs in one step
    assert chunked < 0.1 < whole / 5


def _finish_order(higher_first: bool) -> list[int]:
    e = engine("tiny", scheduling_policy="priority", max_num_seqs=1, higher_priority_first=higher_first)
    reqs = [Request(f"p{p}", prompt(64, p), 2, priority=p, block_size=BS) for p in (5, 1, 3)]
    for r in reqs:
        e.add_request(r)
    e.run_until_idle()
    return [r.priority for r in sorted(reqs, key=lambda r: r.first_token_at or 0)]


def test_priority_order_is_respected() -> None:
    assert _finish_order(higher_first=False) == [1, 3, 5]  # vLLM: lower value first
    assert _finish_order(higher_first=True) == [5, 3, 1]  # SGLang: higher first


def test_memory_pressure_preempts_and_everyone_still_finishes() -> None:
    e = engine("tiny", num_gpu_blocks=64)  # 1,024 tokens
    reqs = [Request(f"q{i}", prompt(200, i), 150, block_size=BS) for i in range(5)]
    for r in reqs:
        e.add_request(r)
    e.run_until_idle()
    assert e.metrics.num_preemptions > 0
    assert all(r.num_output == 150 for r in reqs)
    assert e.pool.num_used == 0


def test_pd_decode_ttft_is_the_transfer_time_not_a_prefill() -> None:
    e = engine()
    n = 8000
    local = run_one(e, prompt(n, 7))
    remote = run_one(e, prompt(n, 8), remote_kv=True)
    c = e.cost
    last_token = c.step_time(StepShape(1, n - 0.5, n, 0, 0, n, 1))
    expected = c.frontend_time(n) + c.transfer_time(n) + last_token
    assert abs(remote.ttft - expected) < 1e-9  # type: ignore[operator]
    assert remote.ttft < local.ttft / 5  # type: ignore[operator]
    assert remote.num_computed == n


def test_prefill_leg_holds_blocks_under_a_lease_until_released() -> None:
    e = engine("tiny", kv_lease_timeout_s=5.0)
    r = run_one(e, prompt(320, 9), kv_lease=True)
    assert len(r.blocks) == 20 and e.pool.num_used == 20
    assert e.release_lease(r.id) and e.pool.num_used == 0
    r2 = run_one(e, prompt(320, 10), kv_lease=True)
    e.advance_to(e.now + 6.0)  # nobody pulled it: the lease expires
    assert e.pool.num_used == 0 and not e.leased and r2.blocks == []


def test_abort_frees_blocks() -> None:
    e = engine("tiny")
    r = Request("a", prompt(1000, 11), 1000, block_size=BS)
    e.add_request(r)
    e.advance_to(0.05)
    assert e.pool.num_used > 0 and r.num_output > 0
    e.abort(r)
    e.run_until_idle()
    assert e.pool.num_used == 0 and not e.running


def test_block_events_match_what_was_stored_and_evicted() -> None:
    e = engine("tiny", num_gpu_blocks=40)
    e.pool.record_events = True
    prompts = [prompt(320, 20 + i) for i in range(4)]  # 20 blocks each: the third evicts the first
    for p in prompts:
        run_one(e, p)
    stored: list[int] = []
    removed: list[int] = []
    for kind, payload in e.pool.take_events():
        if kind == "stored":
            stored += payload[0]  # type: ignore[index]
        elif kind == "removed":
            removed += payload  # type: ignore[operator]
    assert stored == [h for p in prompts for h in block_hashes(p, BS)]
    assert removed and set(removed) <= set(stored)
    assert set(stored) - set(removed) == set(e.pool._cached)


def test_lora_batches_hold_at_most_max_loras_adapters_and_swaps_cost_time() -> None:
    from gateway.sim.lora import LoraConfig

    e = engine("tiny", lora=LoraConfig(enabled=True, max_loras=1, max_cpu_loras=2))
    slots = e.lora_slots
    assert slots is not None
    for a in ("a1", "a2"):
        slots.load(a)  # --lora-modules: in the CPU cache from the start
    seen: list[set[str]] = []
    e.on_step = lambda: seen.append(set(e.lora_running))
    reqs = [Request(f"q{i}", prompt(64, i), 8, block_size=BS, lora=("a1", "a2")[i % 2]) for i in range(6)]
    for r in reqs:
        e.add_request(r)
    e.run_until_idle()
    assert all(r.num_output == 8 for r in reqs)
    assert max(len(s) for s in seen) == 1 and {"a1", "a2"} <= set().union(*seen)  # one adapter per batch
    # The first request of each adapter waits for the others of the resident one: a1's all finish first.
    assert max(r.finished_at for r in reqs[0::2]) < min(r.first_token_at for r in reqs[1::2])  # type: ignore[operator]
    swaps = slots.swaps
    assert swaps == 2 and slots.disk_loads == 2  # a1, then a2 swapped in; both stayed in the CPU cache

    same = prompt(64, 99)
    base = run_one(e, same)
    first = run_one(e, same, lora="a1")
    again = run_one(e, same, lora="a1")
    assert base.num_cached == 0 and first.num_cached == 0 and again.num_cached == 48  # per-adapter cache
    plain = run_one(engine("tiny"), same)
    assert first.ttft - plain.ttft == pytest.approx(slots.swap_s, rel=0.05)  # type: ignore[operator]
