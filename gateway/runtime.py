"""Everything a running gateway holds, built from the settings, and its start and stop."""

from __future__ import annotations

import logging

from gateway.auth import Auth
from gateway.config import Settings
from gateway.health import HealthChecker
from gateway.pool import Pool
from gateway.replica import Replica
from gateway.request_record import Observer, RequestRecord
from gateway.retry_budget import RetryBudget
from gateway.rollout import Router
from gateway.scheduler import Scheduler
from gateway.upstream import Upstream

log = logging.getLogger(__name__)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.auth = Auth(settings)
        self.pools: dict[str, Pool] = {}
        for pcfg in settings.pools:
            pool = Pool(pcfg, settings.breaker, settings.scrape)
            for ep in pcfg.endpoints:
                pool.add_replica(
                    ep.url,
                    name=ep.name,
                    role=ep.role,
                    kind=ep.kind,
                    bootstrap_port=ep.bootstrap_port,
                    healthy=True,
                )
            self.pools[pool.name] = pool
        self.router = Router(settings.routes, {p.name: p.model for p in self.pools.values()})
        self.upstream = Upstream(settings.upstream)
        self.scheduler = Scheduler(settings.scheduler)
        self.retry_budget = RetryBudget(settings.retry.budget_ratio)
        self.health = HealthChecker(settings.health, self.all_replicas, lambda: self.upstream.session)
        self.draining = False
        self.observers: list[Observer] = []

    def observe(self, record: RequestRecord) -> None:
        for observer in self.observers:
            try:
                observer(record)
            except Exception:  # an observer's bug must not fail the request it observes
                log.exception("observer %r failed", observer)

    def all_replicas(self) -> list[Replica]:
        return [r for p in self.pools.values() for r in p.replicas.values()]

    def ready(self) -> dict[str, bool]:
        return {name: pool.has_healthy() for name, pool in self.pools.items()}

    async def start(self) -> None:
        self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        await self.upstream.close()
