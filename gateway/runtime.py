"""Everything a running gateway holds, built from the settings, and its start and stop."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.access_log import access_log
from gateway.auth import Auth
from gateway.config import EndpointConfig, KVEventsSource, Settings
from gateway.conn_guard import ConnectionGuard
from gateway.discovery import make_discovery
from gateway.engine_load import EngineLoad
from gateway.engines.base import KV_EVENTS_TOPIC
from gateway.health import HealthChecker
from gateway.launcher import FleetLauncher, LaunchedReplica
from gateway.load_scraper import LoadScraper
from gateway.lora import LoraWatch
from gateway.metrics import GatewayMetrics
from gateway.model_catalog import ModelCatalog
from gateway.pool import Pool
from gateway.replica import Replica, Role
from gateway.request_record import Observer, RequestRecord
from gateway.retry_budget import RetryBudget
from gateway.rollout import Router
from gateway.scheduler import Scheduler
from gateway.state import make_state
from gateway.tracing import Tracing
from gateway.transports.base import client_tls_context
from gateway.upstream import Upstream
from gateway.variant_stats import VariantStats

log = logging.getLogger(__name__)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.auth = Auth(settings)
        self.pools: dict[str, Pool] = {}
        for pcfg in settings.pools:
            pool = Pool(pcfg, settings.breaker, settings.scrape)
            self.pools[pool.name] = pool
        # Health checks and load scrapes reach https engines as the hot path does.
        tls = settings.upstream.tls
        control_tls = client_tls_context(tls.verify, tls.ca_file) if tls.ca_file or not tls.verify else None
        self.scraper = LoadScraper.from_config(settings.scrape, on_update=self._engine_load, tls=control_tls)
        for pool in self.pools.values():
            for ep in pool.cfg.endpoints:
                self.add_endpoint(pool, ep)
        self.launchers = [
            FleetLauncher(
                pool.name,
                pool.cfg.engines,
                pool.cfg.engines.model or pool.model,
                on_ready=self._launched(pool),
                on_down=self._went_down(pool),
                served_model_name=pool.upstream_model,
            )
            for pool in self.pools.values()
            if pool.cfg.engines is not None
        ]
        # Pools whose replicas come and go with Kubernetes pods (pools[].discovery).
        self.discoveries = [
            d for pool in self.pools.values() if (d := make_discovery(self, pool)) is not None
        ]
        self.router = Router(settings.routes, {p.name: p.model for p in self.pools.values()})
        self.models = ModelCatalog(self.pools, lambda: self.router)
        self.lora = LoraWatch(self.pools.values(), tls=control_tls)
        self.upstream = Upstream(settings.upstream)
        # Large prompts are prepared here, off the event loop; one thread, so that the loop
        # competes with at most one other holder of the GIL.
        self.workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-prepare")
        # Rate limits are charged through the state backend (created last: it wraps the pools'
        # indexes), so with Redis they hold across every gateway instance.
        self.scheduler = Scheduler(settings.scheduler, settings.tenants, take=lambda c: self.state.take(c))
        self.retry_budget = RetryBudget(settings.retry.budget_ratio)
        self.health = HealthChecker(settings.health, self.all_replicas, tls=control_tls)
        self.draining = False
        self.connections: ConnectionGuard | None = None  # set by the server once it listens
        self.observers: list[Observer] = []
        self.tracing = Tracing.from_config(settings.telemetry)  # None when off: the proxy's only cost
        self.metrics = GatewayMetrics(self) if settings.telemetry.metrics else None
        if self.metrics is not None:
            self.observers.append(self.metrics)
        if settings.server.access_log:
            self.observers.append(access_log)
        self.variant_stats = VariantStats()
        self.observers.append(self.variant_stats)
        self.observers.append(self._engine_tokens)
        # Where the settings came from, for reloads (admin API, SIGHUP); set by the server.
        self.config_path: str | None = None
        self.server_overrides: dict[str, Any] = {}
        self.audit: deque[dict[str, Any]] = deque(maxlen=200)  # recent admin changes
        self.state = make_state(self)

    def register(
        self,
        pool: Pool,
        url: str,
        name: str | None,
        role: Role,
        kind: str,
        bootstrap_port: int | None,
        managed: bool = False,
        kv_events: KVEventsSource | None = None,
    ) -> Replica:
        """Add a replica to a pool and start watching its engine's load (and KV events)."""
        replica = pool.add_replica(
            url, name=name, role=role, kind=kind, bootstrap_port=bootstrap_port, managed=managed
        )
        adapter = pool.adapter_for(replica)
        if adapter is not None:
            self.scraper.add(replica.name, replica.url, adapter)
        if pool.precise is not None and kv_events is not None:
            pool.precise.attach(replica.name, kv_events.endpoint, kv_events.topic)
        return replica

    def add_endpoint(self, pool: Pool, ep: EndpointConfig) -> Replica:
        """Add an unmanaged replica (config file, admin API, a peer gateway through shared state)."""
        return self.register(
            pool, ep.url, ep.name, ep.role, ep.kind, ep.bootstrap_port, kv_events=ep.kv_events
        )

    def unregister(self, pool: Pool, name: str) -> Replica | None:
        """Take a replica out of its pool and stop watching it."""
        self.scraper.remove(name)
        self.health.forget(name)
        return pool.remove_replica(name)

    def _launched(self, pool: Pool) -> Callable[[LaunchedReplica], None]:
        def on_ready(launched: LaunchedReplica) -> None:
            pool.remove_replica(launched.name)  # a restarted engine comes back with an empty cache
            self.register(
                pool,
                launched.url,
                launched.name,
                launched.role,
                launched.kind,
                launched.bootstrap_port,
                managed=True,
                kv_events=KVEventsSource(endpoint=launched.kv_events_endpoint, topic=KV_EVENTS_TOPIC)
                if launched.kv_events_endpoint
                else None,
            )

        return on_ready

    def _went_down(self, pool: Pool) -> Callable[[str], None]:
        def on_down(name: str) -> None:
            if self.unregister(pool, name) is not None:
                log.warning(
                    "pool %s: managed replica %s went down; the launcher restarts it", pool.name, name
                )

        return on_down

    def _engine_load(self, name: str, load: EngineLoad) -> None:
        for pool in self.pools.values():
            replica = pool.replicas.get(name)
            if replica is not None:
                capacity_changed = replica.engine.num_gpu_blocks != load.num_gpu_blocks
                replica.engine = load
                if capacity_changed:
                    pool.set_kv_capacity(replica)
                if load.prompt_tokens_total is not None:
                    pool.observe_prompt_counter(name, load.prompt_tokens_total)
                return

    def _engine_tokens(self, record: RequestRecord) -> None:
        """The engine's own prompt token count teaches its pool the engines' tokens per character."""
        pool = self.pools.get(record.pool) if record.pool is not None else None
        if pool is not None and record.engine_prompt_tokens is not None and record.status < 400:
            pool.observe_usage(record.prompt_chars, record.engine_prompt_tokens)

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

    def is_ready(self, pools: dict[str, bool]) -> bool:
        """Whether the gateway can serve, by `server.ready` (never while draining)."""
        rule = self.settings.server.ready
        if self.draining or not pools:
            return False
        if rule == "any":
            return any(pools.values())
        if rule == "all":
            return all(pools.values())
        return all(pools.get(name, False) for name in rule)

    async def start(self) -> None:
        """Start background work; managed replicas join their pools as each becomes ready, so
        the gateway serves (and /ready tells) while slow engines are still loading."""
        await self.state.start()
        self.health.start()
        await self.scraper.start()
        self.lora.start()
        for pool in self.pools.values():
            if pool.precise is not None:
                pool.precise.start()
        for launcher in self.launchers:
            await launcher.start()
        for discovery in self.discoveries:
            discovery.start()

    async def stop(self) -> None:
        # Watchers first, so that engines being stopped are not reported as failing.
        for discovery in self.discoveries:
            await discovery.stop()
        await self.state.stop()
        await self.scraper.stop()
        await self.lora.stop()
        await self.health.stop()
        await self.scheduler.close()
        for launcher in self.launchers:
            await launcher.stop()
        for pool in self.pools.values():
            if pool.precise is not None:
                pool.precise.close()
        await self.upstream.close()
        self.workers.shutdown(wait=False, cancel_futures=True)
        if self.tracing is not None:
            await self.tracing.shutdown()
