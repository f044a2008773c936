"""What the metrics and the status page read of a running gateway: live objects, read when asked.

The composition root hands these over; nothing here reaches for the runtime as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway.admission.scheduler import SchedulerStats
from gateway.fleet.pool import Pool
from gateway.routing.model_catalog import ModelCatalog
from gateway.routing.pool_router import PoolRouter
from gateway.routing.rollout import Rollouts


class ConnectionFigures(Protocol):
    """The client connection counts (gateway.http.conn_guard.ConnectionGuard has them)."""

    open: int
    overflow: int
    closed: dict[str, int]


@dataclass(frozen=True, slots=True)
class GatewayView:
    pools: Mapping[str, Pool]
    routers: Mapping[str, PoolRouter]
    routes: Rollouts
    catalog: ModelCatalog
    scheduler_stats: Callable[[], SchedulerStats]
    draining: Callable[[], bool]
    connections: Callable[[], ConnectionFigures | None]
