"""The fleet: every pool's replicas, and what watches them (load scrapes, health checks, the
launcher of managed engines, discovery from Kubernetes).

Replicas join and leave only through `register` and `unregister`, whoever asks (the config
file, the launcher, discovery, the admin API, a peer gateway through shared state), so a
replica's load scrape, health record and its pool's listeners always follow its membership.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable

from gateway.config import EndpointConfig, KVEventsSource, Settings
from gateway.fleet.discovery import make_discovery
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines.base import KV_EVENTS_TOPIC
from gateway.fleet.health import HealthChecker
from gateway.fleet.launcher import FleetLauncher, LaunchedReplica, PortPlan
from gateway.fleet.load_scraper import LoadScraper
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica, Role

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, settings: Settings, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the upstream TLS settings for health checks and load scrapes, when they are not
        the defaults. Pools start empty: `add_configured_endpoints` fills them, once whoever
        listens to them (their routers) is in place."""
        self.pools: dict[str, Pool] = {
            pcfg.name: Pool(pcfg, settings.breaker, settings.scrape) for pcfg in settings.pools
        }
        self.scraper = LoadScraper.from_config(settings.scrape, on_update=self._engine_load, tls=tls)
        self.health = HealthChecker(settings.health, self.replicas, tls=tls)
        ports = PortPlan.for_settings(settings)  # as `kvgate launch --dry-run` plans them
        self.launchers = [
            FleetLauncher(
                pool.name,
                pool.cfg.engines,
                pool.cfg.engines.model or pool.model,
                on_ready=self._launched(pool),
                on_down=self._went_down(pool),
                served_model_name=pool.upstream_model,
                ports=ports,
            )
            for pool in self.pools.values()
            if pool.cfg.engines is not None
        ]
        # Pools whose replicas come and go with Kubernetes pods (pools[].discovery).
        self.discoveries = [
            d for pool in self.pools.values() if (d := make_discovery(self, pool)) is not None
        ]

    def add_configured_endpoints(self) -> None:
        """Register the unmanaged replicas the config file names."""
        for pool in self.pools.values():
            for ep in pool.cfg.endpoints:
                self.add_endpoint(pool, ep)

    def replicas(self) -> list[Replica]:
        return [r for p in self.pools.values() for r in p.replicas.values()]

    # -- membership ---------------------------------------------------------------------
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
        device: str | None = None,
        kv_side_channel_host: str | None = None,
        kv_side_channel_ports: range | None = None,
    ) -> Replica:
        """Add a replica to a pool and start watching its engine's load (and KV events)."""
        replica = pool.add_replica(
            url,
            name=name,
            role=role,
            kind=kind,
            bootstrap_port=bootstrap_port,
            managed=managed,
            kv_events=kv_events,
            device=device,
            kv_side_channel_host=kv_side_channel_host,
            kv_side_channel_ports=kv_side_channel_ports,
        )
        adapter = pool.adapter_for(replica)
        if adapter.load_path is not None:  # an engine that reports its load
            self.scraper.add(replica.name, replica.url, adapter)
        return replica

    def add_endpoint(self, pool: Pool, ep: EndpointConfig) -> Replica:
        """Add an unmanaged replica (config file, admin API, a peer gateway through shared state)."""
        return self.register(
            pool,
            ep.url,
            ep.name,
            ep.role,
            ep.kind,
            ep.bootstrap_port,
            kv_events=ep.kv_events,
            device=ep.device,
            kv_side_channel_host=ep.kv_side_channel_host,
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
                device=launched.device,
                kv_side_channel_host=launched.kv_side_channel_host,
                kv_side_channel_ports=launched.kv_side_channel_ports,
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
                pool.engine_reported(replica, load)
                return

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start watching; managed replicas join their pools as each becomes ready, so the
        gateway serves (and /ready tells) while slow engines are still loading."""
        self.health.start()
        await self.scraper.start()
        for launcher in self.launchers:
            await launcher.start()
        for discovery in self.discoveries:
            discovery.start()

    async def stop(self) -> None:
        """Stop watching (discovery first, so that engines being stopped are not taken for pods
        that left), then stop the managed engines."""
        for discovery in self.discoveries:
            await discovery.stop()
        await self.scraper.stop()
        await self.health.stop()
        for launcher in self.launchers:
            await launcher.stop()
