"""A pool: the replicas serving one model configuration, and who is told when they change.

Membership only: which replicas there are, which can take a leg now, which engine adapter
reads them. Whatever is learned about replicas for routing (prefix indexes, KV event streams,
token scales) lives in the pool's router (`gateway.routing.pool_router`), which listens to the
pool's changes through `PoolListener`, so this package never imports routing.
"""

from __future__ import annotations

import itertools
import logging
from typing import Protocol

from gateway.config import BreakerConfig, KVEventsSource, PoolConfig, ScrapeConfig
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines import Connector, EngineAdapter, adapter_for_spec, get_adapter
from gateway.fleet.replica import Replica, Role

log = logging.getLogger(__name__)


class PoolListener(Protocol):
    """What a pool tells those who keep state per replica (its router)."""

    def replica_added(self, replica: Replica, kv_events: KVEventsSource | None) -> None:
        """`replica` joined the pool; `kv_events` is where its engine publishes KV events, if known."""

    def replica_removed(self, name: str) -> None:
        """The replica left the pool: forget what was kept for it."""

    def engine_reported(self, replica: Replica, capacity_changed: bool) -> None:
        """The replica's engine figures (`replica.engine`) were refreshed; its KV capacity changed
        when `capacity_changed`."""


class Pool:
    def __init__(self, cfg: PoolConfig, breaker_cfg: BreakerConfig, scrape_cfg: ScrapeConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.model = cfg.model
        self.upstream_model = cfg.served_model or cfg.model
        self._breaker_cfg = breaker_cfg
        self._scrape_cfg = scrape_cfg
        self.replicas: dict[str, Replica] = {}
        self._members: dict[str, list[Replica]] = {}  # by leg, available or not; reset on joins and leaves
        # What clients may send engines that engines would act on (see gateway/path/sanitize.py).
        self.passthrough_fields = frozenset(cfg.client_passthrough.body_fields)
        self.passthrough_headers = frozenset(h.lower() for h in cfg.client_passthrough.headers)
        self._names = itertools.count()
        # Prompt tokens of PD hand-offs whose decode leg has not begun to answer: KV in transfer.
        self.transfer_tokens = 0
        self._listeners: list[PoolListener] = []
        # Managed pools know their engine exactly; unmanaged ones by each endpoint's kind.
        self.adapter = adapter_for_spec(cfg.engines) if cfg.engines is not None else None
        # The dialect a request to the pool is written in (one body serves every replica its
        # retries may walk): the launched engine's, else the kind of the first endpoint configured
        # or discovered; None until a replica says, for a pool given neither.
        kind = (
            cfg.endpoints[0].kind
            if cfg.endpoints
            else cfg.discovery.kubernetes.kind
            if cfg.discovery
            else None
        )
        self._dialect = self.adapter or (get_adapter(kind) if kind is not None else None)

    def listen(self, listener: PoolListener) -> None:
        self._listeners.append(listener)

    def adapter_for(self, replica: Replica) -> EngineAdapter:
        return self.adapter if self.adapter is not None else get_adapter(replica.kind)

    @property
    def dialect(self) -> EngineAdapter | None:
        """The pool's engines' adapter for what the request path writes and reads (None: no
        replica and no configured kind to say)."""
        if self._dialect is None and self.replicas:
            return self.adapter_for(next(iter(self.replicas.values())))
        return self._dialect

    @property
    def connector(self) -> Connector | None:
        """How the pool's prefill replicas hand their KV to decode replicas (None: no hand-off)."""
        prefill = next((r for r in self.replicas.values() if r.role == "prefill"), None)
        return self.adapter_for(prefill).connector if prefill is not None else None

    def priority_adapter(self) -> EngineAdapter | None:
        """The adapter of engines that schedule by body `priority` (None: they do not)."""
        cfg = self.cfg
        if cfg.engines is not None:  # a managed fleet runs priority scheduling only if launched so
            return self.adapter if cfg.engines.priority_scheduling else None
        if not cfg.priority_scheduling:
            return None
        return self.direction_adapter()

    def direction_adapter(self) -> EngineAdapter | None:
        """The adapter that says which way the pool's engines read `priority` (None: they do not)."""
        if self.adapter is not None:
            return self.adapter
        # One body serves every replica the retries may walk: the pool's first replica sets the direction.
        first = next(iter(self.replicas.values()), None)
        adapter = self.adapter_for(first) if first is not None else None
        return adapter if adapter is not None and adapter.schedules_by_priority else None

    # -- membership -------------------------------------------------------------------
    def add_replica(
        self,
        url: str,
        *,
        name: str | None = None,
        role: Role = "mixed",
        kind: str = "vllm",
        bootstrap_port: int | None = None,
        managed: bool = False,
        healthy: bool = True,
        kv_events: KVEventsSource | None = None,
        device: str | None = None,
        kv_side_channel_host: str | None = None,
        kv_side_channel_ports: range | None = None,
    ) -> Replica:
        if name is None:
            name = f"{self.name}-{next(self._names)}"
            while name in self.replicas:
                name = f"{self.name}-{next(self._names)}"
        if name in self.replicas:
            raise ValueError(f"pool {self.name}: replica {name!r} exists")
        replica = Replica(
            name,
            url,
            self.name,
            role=role,
            kind=kind,
            breaker=CircuitBreaker(self._breaker_cfg.failure_threshold, self._breaker_cfg.open_s),
            bootstrap_port=bootstrap_port,
            managed=managed,
            healthy=healthy,
            stale_after_s=self._scrape_cfg.stale_after_s,
            device=device,
            kv_side_channel_host=kv_side_channel_host,
            kv_side_channel_ports=kv_side_channel_ports,
        )
        self.replicas[name] = replica
        self._members.clear()
        log.info("pool %s: replica %s added at %s (role %s)", self.name, name, replica.url, role)
        if role == "prefill" and kv_side_channel_host is None:
            log.info(
                "pool %s: prefill replica %s hands its KV over only from %s (its URL's host; set "
                "kv_side_channel_host where its engine names another)",
                self.name,
                name,
                replica.kv_side_channel_host,
            )
        for listener in self._listeners:
            listener.replica_added(replica, kv_events)
        return replica

    def remove_replica(self, name: str) -> Replica | None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            self._members.clear()
            for listener in self._listeners:
                listener.replica_removed(name)
            log.info("pool %s: replica %s removed", self.name, name)
        return replica

    def engine_reported(self, replica: Replica, load: EngineLoad) -> None:
        """A fresh scrape of the replica's engine."""
        old = replica.engine
        capacity_changed = (old.num_gpu_blocks, old.cpu_capacity_tokens) != (
            load.num_gpu_blocks,
            load.cpu_capacity_tokens,
        )
        replica.engine = load
        for listener in self._listeners:
            listener.engine_reported(replica, capacity_changed)

    @property
    def disaggregated(self) -> bool:
        return any(r.role == "prefill" for r in self.replicas.values())

    @staticmethod
    def takes(replica: Replica, role: str) -> bool:
        """Whether `replica` can take the given leg: `decode` legs also go to mixed ones."""
        return (replica.role == "prefill") == (role == "prefill")

    def members(self, role: str) -> list[Replica]:
        """Replicas that can take the given leg, available or not. The list is shared until the
        membership changes: do not modify it."""
        found = self._members.get(role)
        if found is None:
            found = self._members[role] = [r for r in self.replicas.values() if self.takes(r, role)]
        return found

    def on_device(self, role: str, device: str) -> list[Replica]:
        """`members(role)` on one device (a GPU several engine processes share)."""
        key = f"{role}@{device}"
        found = self._members.get(key)
        if found is None:
            found = self._members[key] = [r for r in self.members(role) if r.device == device]
        return found

    def serving(self, role: str) -> list[Replica]:
        """Available replicas that can take the given leg: `decode` legs also go to mixed ones."""
        return [r for r in self.members(role) if r.available]

    def has_healthy(self) -> bool:
        return any(r.healthy and r.role != "prefill" for r in self.replicas.values())
