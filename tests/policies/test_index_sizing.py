"""The prefix index is sized from the engine's KV capacity in tokens, at the measured tokens per block."""

from __future__ import annotations

import time

from bench import text
from bench.decision_time import build_pool
from gateway.fleet.engine_load import EngineLoad


def test_index_capacity_follows_measured_characters_per_token() -> None:
    pool = build_pool(1, "prefix_affinity")
    replica = pool.pool.replicas["r0"]
    replica.engine = EngineLoad(num_gpu_blocks=4096, block_size=16, updated_at=time.monotonic())
    pool.set_kv_capacity(replica)
    capacity = pool.prefix_index.stats()["replicas"]["r0"]["capacity"]  # type: ignore[index]
    assert capacity == 65536 // 16  # before any traffic: 4 characters per token assumed
    # Benchmark text runs at about 7 characters per token: a 64-character block holds ~9 tokens.
    for i in range(8):
        body = {"model": "m", "messages": [{"role": "user", "content": text.words(f"k{i}", 500)}]}
        pool.features(body, "chat", f"r{i}", {})
    per_block = pool.tokens_per_block()
    assert 7 < per_block < 11
    capacity = pool.prefix_index.stats()["replicas"]["r0"]["capacity"]  # type: ignore[index]
    assert abs(capacity * per_block - 65536) <= 0.2 * 65536  # resized (within the 20% hysteresis)
