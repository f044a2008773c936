"""A pool's router: request features, the candidates handed to a policy (matched blocks and
tokens), and the prefix index sized from the engine's KV capacity at the measured tokens per block."""

from __future__ import annotations

import time

from gateway.fleet.engine_load import EngineLoad
from gateway.routing.prefix_hash import PrefixHasher, prompt_text
from gateway.routing.tokens import get_tokenizer
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
        pool.prefix_index.record(name, features.block_hashes[:k])
    serving = pool.pool.serving("decode")
    candidates = pool.candidates(features, serving, pool.policy)
    assert [c.replica for c in candidates] == serving
    for c in candidates:
        k = depths[c.replica.name]
        assert (c.matched_blocks, c.matched_tokens) == (k, sum(features.block_tokens[:k]))
    # A policy that does not use prefix matches is not given any, though the index has them.
    blind = pool_router(3, "round_robin")
    blind.prefix_index.record("r0", features.block_hashes)
    assert [
        (c.matched_blocks, c.matched_tokens)
        for c in blind.candidates(features, blind.pool.serving("decode"), blind.policy)
    ] == [(0, 0)] * 3


def test_index_capacity_follows_measured_characters_per_token() -> None:
    router = pool_router(1, "prefix_affinity")
    replica = router.pool.replicas["r0"]
    replica.engine = EngineLoad(num_gpu_blocks=4096, block_size=16, updated_at=time.monotonic())
    router.set_kv_capacity(replica)
    capacity = router.prefix_index.stats()["replicas"]["r0"]["capacity"]  # type: ignore[index]
    assert capacity == 65536 // 16  # before any traffic: 4 characters per token assumed
    # Long words run well above 4 characters per token: a 64-character block holds fewer tokens.
    texts = [" ".join(["international organization"] * 60 + [prose(f"k{i}", 200)]) for i in range(8)]
    for i, content in enumerate(texts):
        router.features(
            {"model": "m", "messages": [{"role": "user", "content": content}]}, "chat", f"r{i}", {}
        )
    measured = 64 * sum(get_tokenizer().count(t) for t in texts) / sum(len(t) for t in texts)
    per_block = router.tokens_per_block()
    assert abs(per_block - measured) < 0.1 * measured and per_block < 0.8 * 16
    capacity = router.prefix_index.stats()["replicas"]["r0"]["capacity"]  # type: ignore[index]
    assert abs(capacity * per_block - 65536) <= 0.2 * 65536  # resized (within the 20% hysteresis)
