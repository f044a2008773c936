"""A pool's router: request features, the candidates handed to a policy (matched blocks and
tokens), and the prefix index sized from the engine's KV capacity at the measured tokens per block."""

from __future__ import annotations

import time

from gateway.fleet.engine_load import EngineLoad
from gateway.prompt.prefix_hash import PrefixHasher, prompt_text
from gateway.prompt.tokens import get_tokenizer
from tests.routing.helpers import pool_router, prose


def chat(system: str, user: str) -> dict[str, object]:
    return {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "lookup"}}],
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def test_features_match_the_uncached_hasher() -> None:
    pool = pool_router(2, "prefix_affinity")
    system = prose("system", 600)
    for i in range(3):  # the system prompt is computed once, then served from the piece cache
        body = chat(system, prose(f"question {i}", 40))
        got = pool.features(body, "chat", f"r{i}", {})
        want = PrefixHasher(block_chars=64).features("m", None, prompt_text(body, "chat"))
        assert got.text == prompt_text(body, "chat")
        assert (list(got.block_hashes), list(got.block_tokens), got.prompt_tokens) == (
            want.block_hashes,
            want.block_tokens,
            want.prompt_tokens,
        )


def test_candidates_carry_each_replicas_leading_match() -> None:
    pool = pool_router(40, "prefix_affinity")
    features = pool.features(chat(prose("s", 800), "hello"), "chat", "r", {})
    n = len(features.block_hashes)
    depths = {f"r{i}": (i * 7) % (n + 1) for i in range(40)}  # many distinct depths, some 0, some all
    for name, k in depths.items():
        pool.match.index.record(name, features.block_hashes[:k])
    serving = pool.pool.serving("decode")
    candidates = pool.match.candidates(features, serving)
    assert [c.replica for c in candidates] == serving
    for c in candidates:
        k = depths[c.replica.name]
        assert (c.matched_blocks, c.matched_tokens) == (k, sum(features.block_tokens[:k]))
    # A policy that does not use prefix matches is not given any, though the index has them.
    blind = pool_router(3, "round_robin")
    blind.match.index.record("r0", features.block_hashes)
    assert [(c.matched_blocks, c.matched_tokens) for c in blind.offered(features, "decode")] == [(0, 0)] * 3


def test_index_capacity_follows_measured_characters_per_token() -> None:
    router = pool_router(1, "prefix_affinity")
    replica = router.pool.replicas["r0"]
    replica.engine = EngineLoad(num_gpu_blocks=4096, block_size=16, updated_at=time.monotonic())
    router.engine_reported(replica, capacity_changed=True)
    capacity = router.match.index.stats()["replicas"]["r0"]["capacity"]  # type: ignore[index]
    assert capacity == 65536 // 16  # before any traffic: 4 characters per token assumed
    # Long words run well above 4 characters per token: a 64-character block holds fewer tokens.
    texts = [" ".join(["international organization"] * 60 + [prose(f"k{i}", 200)]) for i in range(8)]
    for i, content in enumerate(texts):
        router.features(
            {"model": "m", "messages": [{"role": "user", "content": content}]}, "chat", f"r{i}", {}
        )
    measured = 64 * sum(get_tokenizer().count(t) for t in texts) / sum(len(t) for t in texts)
    per_block = router.scale.tokens_per_block()
    assert abs(per_block - measured) < 0.1 * measured and per_block < 0.8 * 16
    capacity = router.match.index.stats()["replicas"]["r0"]["capacity"]  # type: ignore[index]
    assert abs(capacity * per_block - 65536) <= 0.2 * 65536  # resized (within the 20% hysteresis)


def test_an_engine_offloading_to_cpu_keeps_an_evicted_prefix_matchable_as_cpu_resident() -> None:
    router = pool_router(2, "prefix_affinity")
    offloads, plain = router.pool.replicas["r0"], router.pool.replicas["r1"]
    # GPU room for two and a half prompts' blocks, CPU room for ten (at the measured tokens per block).
    prompts = [router.features(chat(prose(f"p{i}", 400), "q"), "chat", f"q{i}", {}) for i in range(4)]
    blocks = len(prompts[0].block_hashes)
    gpu_tokens = int(2.5 * blocks * router.scale.tokens_per_block())
    offloads.engine = EngineLoad(
        num_gpu_blocks=gpu_tokens // 16, block_size=16, cpu_capacity_tokens=4 * gpu_tokens
    )
    plain.engine = EngineLoad(num_gpu_blocks=gpu_tokens // 16, block_size=16)
    for replica in (offloads, plain):
        router.engine_reported(replica, capacity_changed=True)
        for features in prompts:
            router.learn(features, replica)
    first = {c.replica.name: c for c in router.match.candidates(prompts[0], [offloads, plain])}
    gpu = first["r0"].matched_blocks  # the head the prompts share (their tools) is still on the GPU
    assert gpu <= 1 and first["r0"].cpu_matched_blocks == blocks - gpu
    assert first["r0"].cpu_matched_tokens == sum(prompts[0].block_tokens[gpu:])
    assert (first["r1"].matched_blocks, first["r1"].cpu_matched_blocks) == (gpu, 0)
    last = {c.replica.name: c for c in router.match.candidates(prompts[3], [offloads, plain])}
    assert (last["r0"].matched_blocks, last["r0"].cpu_matched_blocks) == (len(prompts[3].block_hashes), 0)
    # Restarted without its CPU tier: nothing is believed offloaded any more.
    offloads.engine = EngineLoad(num_gpu_blocks=gpu_tokens // 16, block_size=16)
    router.engine_reported(offloads, capacity_changed=True)
    first = {c.replica.name: c for c in router.match.candidates(prompts[0], [offloads])}
    assert first["r0"].cpu_matched_blocks == 0


def test_a_large_pool_offers_the_prompts_holders_and_a_sample_of_the_rest() -> None:
    pool = pool_router(256, "prefix_affinity", max_candidates=32)
    features = pool.features(chat(prose("s", 800), "hello"), "chat", "r", {})
    n = len(features.block_hashes)
    held = {"r7": n, "r200": n // 2, "r13": 3}
    for name, k in held.items():
        pool.match.index.record(name, features.block_hashes[:k])
    seen: set[str] = set()
    for _ in range(50):
        offered = pool.offered(features, "decode")
        names = [c.replica.name for c in offered]
        assert len(names) == len(set(names)) == 32
        assert held.keys() <= set(names)  # every holder, with its match
        assert {c.replica.name: c.matched_blocks for c in offered if c.matched_blocks} == held
        seen.update(names)
    assert len(seen) > 200  # the rest is sampled afresh each time, over the whole pool
    assert pool.rank(features)[0].replica.name == "r7"


def test_a_shortlist_keeps_the_deepest_of_many_holders_and_only_available_replicas() -> None:
    pool = pool_router(128, "prefix_affinity", max_candidates=16)
    features = pool.features(chat(prose("s", 800), "hello"), "chat", "r", {})
    n = len(features.block_hashes)
    for i in range(0, 128, 2):  # half the pool holds the first blocks, a few hold it all
        pool.match.index.record(f"r{i}", features.block_hashes[: n if i % 32 == 0 else 2])
    for i in range(1, 128, 4):
        pool.pool.replicas[f"r{i}"].healthy = False
    for _ in range(20):
        offered = pool.offered(features, "decode")
        assert all(c.replica.healthy for c in offered)
        deepest = {c.replica.name for c in offered if c.matched_blocks == n}
        assert deepest == {"r0", "r32", "r64", "r96"}
        assert sum(1 for c in offered if c.matched_blocks == 2) >= 4  # the rest of half the limit
    # Only one replica available: it is found though no shortlist would have drawn it.
    for r in pool.pool.replicas.values():
        r.healthy = r.name == "r77"
    assert [c.replica.name for c in pool.rank(features)] == ["r77"]


def test_a_shortlist_brings_every_replica_sharing_a_gpu() -> None:
    pool = pool_router(96, "prefix_affinity", max_candidates=8, devices=24)  # four replicas per GPU
    features = pool.features(chat(prose("s", 300), "hi"), "chat", "r", {})
    offered = pool.offered(features, "decode")
    devices: dict[str | None, int] = {}
    for c in offered:
        devices[c.replica.device] = devices.get(c.replica.device, 0) + 1
    assert set(devices.values()) == {4}


def test_small_pools_and_policies_without_prefix_matches_are_offered_every_replica() -> None:
    for size, limit, policy in (
        (32, 32, "prefix_affinity"),
        (64, 0, "prefix_affinity"),
        (64, 8, "least_load"),
    ):
        pool = pool_router(size, policy, max_candidates=limit)
        features = pool.features(chat("s", "hi"), "chat", "r", {})
        assert len(pool.offered(features, "decode")) == size


def test_a_cpu_tier_shared_by_tensor_parallel_workers_holds_its_share() -> None:
    """vLLM 0.26 splits --kv-offloading-size among a replica's workers, each keeping its own shard of
    every block: with tensor_parallel_size 2 the tier holds half the tokens its bytes suggest."""
    from gateway.config import PoolConfig
    from gateway.routing.matching import PrefixMatch

    sized = {}
    for tp in (1, 2):
        engines = {"kind": "vllm", "tensor_parallel_size": tp, "gpu_ids": [[0, 1]]}
        match = PrefixMatch(PoolConfig(name="p", model="m", engines=engines), "m")
        replica = pool_router(1, "prefix_affinity").pool.replicas["r0"]
        replica.engine = EngineLoad(num_gpu_blocks=1024, block_size=16, cpu_capacity_tokens=64_000)
        match.set_capacity(replica, lambda: 16.0)
        assert match.approximate.lower is not None
        sized[tp] = match.approximate.lower.stats()["replicas"]["r0"]["capacity"]
    assert sized == {1: 4000, 2: 2000}
