"""The composition root: everything a running gateway holds, built from the settings and wired
together here (the only module that knows every part), and its start and stop.

Each part gets what it uses and nothing more: the fleet and its pools, each pool's router, the
rollout router, the scheduler, the upstream client, a tracer, the observers of each request's
record. No part is handed the runtime itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from gateway.admission.scheduler import Scheduler
from gateway.config import Settings
from gateway.control.audit import AuditTrail
from gateway.control.reload import Reloader
from gateway.control.state import make_state
from gateway.control.variant_stats import VariantStats
from gateway.fleet.fleet import Fleet
from gateway.fleet.pool import Pool
from gateway.http.api_routes import ApiRoutes
from gateway.http.app import DataPlane
from gateway.http.auth import Auth
from gateway.http.conn_guard import ConnectionGuard
from gateway.http.tenant_caps import TenantCaps
from gateway.observe.access_log import access_log
from gateway.observe.dashboard import Dashboard
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.tracing import Tracing
from gateway.observe.view import GatewayView, RoutedTotals
from gateway.path.exchange import Route
from gateway.path.prepare import Preparation
from gateway.path.proxy import Proxy
from gateway.path.request_record import Observer, RequestRecord
from gateway.path.retry_budget import RetryBudget
from gateway.path.tokenize import Tokenize
from gateway.path.trace import NO_TRACER, Tracer
from gateway.path.transports.base import client_tls_context
from gateway.path.upstream import Upstream
from gateway.routing.lora import LoraWatch
from gateway.routing.model_catalog import ModelCatalog
from gateway.routing.pool_router import PoolRouter
from gateway.routing.rollout import Rollouts

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from gateway.epp.server import EppServer

log = logging.getLogger(__name__)


class Runtime:
    def __init__(
        self,
        settings: Settings,
        config_path: str | None = None,
        server_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.auth = Auth(settings)
        # Health checks and load scrapes reach https engines as the hot path does.
        tls = settings.upstream.tls
        control_tls = client_tls_context(tls.verify, tls.ca_file) if tls.ca_file or not tls.verify else None
        self.fleet = Fleet(settings, control_tls)
        self.pools: dict[str, Pool] = self.fleet.pools
        # Each pool's router listens to its pool before any replica joins.
        self.routers: dict[str, PoolRouter] = {name: PoolRouter(pool) for name, pool in self.pools.items()}
        self.fleet.add_configured_endpoints()
        self.rollouts = Rollouts(settings.routes, {p.name: p.model for p in self.pools.values()})
        self.catalog = ModelCatalog(self.routers, self.rollouts)
        # LoRA adapters: each replica's list read from its /v1/models, and loads on demand.
        self.lora = LoraWatch((r.lora for r in self.routers.values()), tls=control_tls)
        self.upstream = Upstream(settings.upstream)
        # Large prompts are prepared here, off the event loop; one thread, so that the loop
        # competes with at most one other holder of the GIL.
        self.workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-prepare")
        # State shared with other gateway instances (Redis), or this instance's own (memory).
        self.state = make_state(settings.state, self.fleet, self.rollouts)
        for router in self.routers.values():
            # Precise mode needs nothing shared: every instance subscribes to the same KV events.
            router.match.share(functools.partial(self.state.share_index, router.name))
        # Rate limits are charged through the state backend, so with Redis they hold fleet-wide.
        self.scheduler = Scheduler(settings.scheduler, settings.tenants, take=self.state.take)
        retry = settings.retry
        self.retry_budget = RetryBudget(retry.budget_ratio, retry.budget_floor, retry.budget_refill_s)
        self.draining = False
        self.connections: ConnectionGuard | None = None  # set by the server once it listens
        self.observers: list[Observer] = []
        self.tracing = Tracing.from_config(settings.telemetry)
        tracer: Tracer = self.tracing if self.tracing is not None else NO_TRACER
        # What the metrics and the status page read, each when asked.
        self.view = GatewayView(
            pools=self.pools,
            routers=self.routers,
            routes=self.rollouts,
            catalog=self.catalog,
            scheduler_stats=self.scheduler.stats,
            draining=lambda: self.draining,
            connections=lambda: self.connections,
            routed=RoutedTotals(self.pools),
        )
        self.metrics = GatewayMetrics(self.view) if settings.telemetry.metrics else None
        if self.metrics is not None:
            self.observers.append(self.metrics)
        if settings.server.access_log:
            self.observers.append(access_log)
        self.variant_stats = VariantStats()
        if self.auth.admin is not None:  # read by the admin API alone: no control plane, no reader
            self.observers.append(self.variant_stats)
        self.observers.append(self._engine_tokens)
        self.audit = AuditTrail()
        # Reloads (admin API, SIGHUP) re-read `config_path`; the command line's server.* values win.
        self.reloader = Reloader(
            settings, self.fleet, self.rollouts, self.state, self.audit, config_path, server_overrides
        )
        self.dashboard = Dashboard(
            self.view, self.metrics, tracing=self.tracing is not None, check_admin=self.auth.admin
        )

        self.preparation = preparation = Preparation(
            settings.server,
            self.catalog,
            self.scheduler.classes,
            self.upstream,
            self.workers,
            tracer,
        )
        proxy = Proxy(
            settings.retry,
            settings.scheduler.retry_after_s,
            preparation,
            self.scheduler,
            self.upstream,
            self.retry_budget,
            tracer,
            self.lora,
        )
        tokenize = Tokenize(
            self.catalog, self.upstream, settings.retry.max_attempts, settings.scheduler.retry_after_s
        )
        caps = TenantCaps(settings)
        self.data_plane = DataPlane(
            settings.server,
            proxy,
            ApiRoutes(settings.server, self.auth, caps, self.catalog, tokenize, self.observe),
            self.auth,
            self.observe,
            tracer,
            self.rollouts,
            self.pools,
            lambda: self.draining,
            caps,
        )

    def routes(self) -> list[Route]:
        """The data plane's routes: the OpenAI routes and probes, metrics and the status page (both
        read-only: Prometheus and the page's readers reach them where clients do)."""
        metrics = [] if self.metrics is None else [Route("GET", "/metrics", self.metrics.handle)]
        return [*self.data_plane.http_routes(), *metrics, *self.dashboard.routes()]

    def probe_routes(self) -> list[Route]:
        """EPP mode's HTTP routes: the GET ones (probes, the model list, metrics, the status page);
        inference requests come through Envoy, never here."""
        return [r for r in self.routes() if r.method == "GET"]

    def ready(self) -> bool:
        """Whether the gateway can serve, by `server.ready` (what /ready answers)."""
        return self.data_plane.is_ready(self.data_plane.pools_ready())

    def endpoint_picker(self) -> EppServer:
        """EPP mode's gRPC server (not started): the proxy's preparation, admission and routing
        deciding for an Envoy gateway. gRPC is imported only here (the `kvgate[epp]` extra)."""
        from gateway.epp.picking import Picker
        from gateway.epp.processor import Processor
        from gateway.epp.server import EppServer

        settings = self.settings
        picker = Picker(
            settings.epp,
            settings.retry,
            settings.scheduler.retry_after_s,
            self.preparation,
            self.scheduler,
            self.pools,
            self.lora,
            self.observe,
        )
        return EppServer(settings.epp, Processor(picker, settings.server, settings.epp), self.ready)

    def control_app(self) -> ASGIApp | None:
        """The control plane's app (the admin API, its schema and docs page); None without an
        admin key, and then there is no control plane."""
        check_admin = self.auth.admin
        if check_admin is None:
            return None
        # FastAPI takes about half a second to import: only a gateway with a control plane pays it.
        from gateway.control.admin import Admin

        admin = Admin(self.fleet, self.rollouts, self.state, self.reloader, self.audit, self.variant_stats)
        return admin.app(check_admin)

    @property
    def settings(self) -> Settings:
        """The settings in force (a reload replaces them)."""
        return self.reloader.settings

    def _engine_tokens(self, record: RequestRecord) -> None:
        """The engine's own prompt token count teaches its pool the engines' tokens per character."""
        router = self.routers.get(record.pool) if record.pool is not None else None
        if router is not None and record.engine_prompt_tokens is not None and record.status < 400:
            router.observe_usage(record.prompt_chars, record.engine_prompt_tokens)

    def observe(self, record: RequestRecord) -> None:
        for observer in self.observers:
            try:
                observer(record)
            except Exception:  # an observer's bug must not fail the request it observes
                log.exception("observer %r failed", observer)

    async def start(self) -> None:
        """Start background work; managed replicas join their pools as each becomes ready, so
        the gateway serves (and /ready tells) while slow engines are still loading."""
        await self.state.start()
        for router in self.routers.values():
            if router.precise is not None:
                router.precise.start()
        self.lora.start()
        await self.fleet.start()

    async def stop(self) -> None:
        await self.state.stop()
        await self.lora.stop()
        await self.scheduler.close()
        await self.fleet.stop()
        for router in self.routers.values():
            if router.precise is not None:
                router.precise.close()
        await self.upstream.close()
        self.workers.shutdown(wait=False, cancel_futures=True)
        if self.tracing is not None:
            await self.tracing.shutdown()
