"""State shared by several gateway instances: in-flight load, prefix index, route weights, rate limits.

`make_state(cfg, fleet, router)` returns the configured backend: `memory` (one instance, nothing shared) or
`redis`. The request path only ever reads local memory; a backend keeps it in sync off the path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.control.state.base import Bucket, StateBackend
from gateway.control.state.memory import MemoryState

if TYPE_CHECKING:
    from gateway.config import StateConfig
    from gateway.fleet.fleet import Fleet
    from gateway.routing.rollout import Rollouts

__all__ = ["Bucket", "MemoryState", "StateBackend", "make_state"]


def make_state(cfg: StateConfig, fleet: Fleet, router: Rollouts) -> StateBackend:
    if cfg.backend == "redis":
        from gateway.control.state.redis_backend import RedisState

        return RedisState(cfg, fleet, router)
    return MemoryState(cfg, fleet, router)
