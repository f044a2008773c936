"""Pool: request features and the candidates handed to a policy (matched blocks and tokens)."""

from __future__ import annotations

from bench import text
from bench.decision_time import build_pool
from gateway.routing.prefix_hash import PrefixHasher, prompt_text


def chat(system: str, user: str) -> dict[str, object]:
    return {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "lookup"}}],
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def test_features_match_the_uncached_hasher() -> None:
    pool = build_pool(2, "prefix_affinity")
    system = text.words("system", 600)
    for i in range(3):  # the system prompt is computed once, then served from the piece cache
        body = chat(system, text.words(f"question {i}", 40))
        got = pool.features(body, "chat", f"r{i}", {})
        want = PrefixHasher(block_chars=64).features("m", None, prompt_text(body, "chat"))
        assert got.text == prompt_text(body, "chat")
        assert (list(got.block_hashes), list(got.block_tokens), got.prompt_tokens) == (
            want.block_hashes,
            want.block_tokens,
            want.prompt_tokens,
        )


def test_candidates_carry_each_replicas_leading_match() -> None:
    pool = build_pool(40, "prefix_affinity")
    features = pool.features(chat(text.words("s", 800), "hello"), "chat", "r", {})
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
    blind = build_pool(3, "round_robin")
    blind.prefix_index.record("r0", features.block_hashes)
    assert [
        (c.matched_blocks, c.matched_tokens)
        for c in blind.candidates(features, blind.pool.serving("decode"), blind.policy)
    ] == [(0, 0)] * 3
