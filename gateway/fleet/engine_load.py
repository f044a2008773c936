"""An engine's own view of its load, as scraped from its metrics or load endpoint."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineLoad:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    # KV tokens the engine can keep in CPU memory (vLLM's --kv-offloading-size), where it says.
    cpu_capacity_tokens: int | None = None
    prompt_tokens_total: float | None = None  # the engine's prompt token counter, where it has one
    # Its own counts of prompt tokens found in its GPU prefix cache and loaded from its CPU tier, and
    # of CPU tier loads (vLLM), where it has them: what the gateway's matches are checked against.
    gpu_hit_tokens_total: float | None = None
    cpu_hit_tokens_total: float | None = None
    cpu_loads_total: float | None = None
    updated_at: float = field(default=0.0)  # time.monotonic() of the scrape; 0 = never

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size

    def is_fresh(self, max_age_s: float, now: float | None = None) -> bool:
        if self.updated_at == 0.0:
            return False
        return ((time.monotonic() if now is None else now) - self.updated_at) <= max_age_s
