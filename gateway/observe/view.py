"""What the metrics and the status page read of a running gateway: live objects, read when asked.

The composition root hands these over; nothing here reaches for the runtime as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway.admission.scheduler import SchedulerStats
from gateway.config import KVEventsSource
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.routing.model_catalog import ModelCatalog
from gateway.routing.pool_router import PoolRouter
from gateway.routing.rollout import Rollouts


class ConnectionFigures(Protocol):
    """The client connection counts (gateway.http.conn_guard.ConnectionGuard has them)."""

    open: int
    overflow: int
    closed: dict[str, int]


class RoutedTotals:
    """Requests this gateway sent to each replica since it started, by pool and replica name. A
    launched engine that restarts rejoins as a new replica of the same name, counting from 0: its
    predecessors' counts are carried, so the status page's and `/metrics`' totals never go back."""

    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self._pools = {name: _PoolTotals(pool) for name, pool in pools.items()}

    def of(self, replica: Replica) -> int:
        return self._pools[replica.pool].earlier.get(replica.name, 0) + replica.total_requests


class _PoolTotals:
    """One pool's listener: the replicas in it, and what those of each name that left had counted."""

    def __init__(self, pool: Pool) -> None:
        self.live = dict(pool.replicas)
        self.earlier: dict[str, int] = {}
        pool.listen(self)

    def replica_added(self, replica: Replica, kv_events: KVEventsSource | None) -> None:
        self.live[replica.name] = replica

    def replica_removed(self, name: str) -> None:
        gone = self.live.pop(name, None)
        if gone is not None:  # its count is final: a replica out of the pool is leased no more
            self.earlier[name] = self.earlier.get(name, 0) + gone.total_requests

    def engine_reported(self, replica: Replica, capacity_changed: bool) -> None:
        pass


@dataclass(frozen=True, slots=True)
class GatewayView:
    pools: Mapping[str, Pool]
    routers: Mapping[str, PoolRouter]
    routes: Rollouts
    catalog: ModelCatalog
    scheduler_stats: Callable[[], SchedulerStats]
    draining: Callable[[], bool]
    connections: Callable[[], ConnectionFigures | None]
    routed: RoutedTotals
