"""Pool routers built in process, with no gateway around them, and prompt text to route."""

from __future__ import annotations

import random

from gateway.config import load_config
from gateway.fleet.pool import Pool
from gateway.routing.pool_router import PoolRouter

_WORDS = (
    "garden", "tools", "rake", "spade", "soil", "clay", "weather", "season", "harvest", "water",
    "question", "answer", "support", "customer", "delivery", "invoice", "international", "organization",
)  # fmt: skip


def pool_router(
    replicas: int, policy: str, block_chars: int = 64, max_candidates: int = 32, devices: int = 0
) -> PoolRouter:
    """The router of a pool of `replicas` replicas (r0, r1, ...), each available; with `devices`,
    replica i shares GPU `g{i % devices}`."""
    urls = [f"http://127.0.0.1:{10000 + i}" for i in range(replicas)]
    pcfg = {
        "name": "p",
        "model": "m",
        "policy": {"type": policy, "max_candidates": max_candidates},
        "prefix": {"block_chars": block_chars},
        "endpoints": [{"url": url} for url in urls],
    }
    settings = load_config(None, {"pools": [pcfg]})
    pool = Pool(settings.pools[0], settings.breaker, settings.scrape)
    router = PoolRouter(pool)
    for i, url in enumerate(urls):
        pool.add_replica(url, name=f"r{i}", device=f"g{i % devices}" if devices else None)
    return router


def prose(key: str, words: int) -> str:
    """`words` words of text, the same for the same key."""
    return " ".join(random.Random(key).choices(_WORDS, k=words))
