"""How a discovery source changes a pool: add, drain, remove replicas, through one narrow interface.

A source (Kubernetes today) only computes which endpoints should serve a pool right now and
hands that set to `Reconciler.sync`. The reconciler diffs it against what it added before: a new
endpoint joins the pool; one that left (pod unready, deleted, out of the selector) is drained at
once (no new requests, the ones in flight finish) and removed when it is idle or after
`drain_timeout_s`; one that comes back while still draining is undrained, keeping its prefix
index. The pool is reached only through `Membership`, so the source knows nothing of the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.config import KVEventsSource
from gateway.fleet.replica import Replica, Role

if TYPE_CHECKING:
    from gateway.fleet.pool import Pool

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often a draining replica's in-flight count is looked at


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine a source found ready to serve."""

    name: str  # preferred replica name (the pod's), made unique by the membership if taken
    url: str
    role: Role = "mixed"
    kind: str = "vllm"
    bootstrap_port: int | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None


class Membership(Protocol):
    """What a discovery source may do to its pool."""

    pool: str

    def add(self, ep: Endpoint) -> str:
        """Add a replica for `ep`; returns the replica's name."""

    def set_draining(self, name: str, draining: bool) -> bool:
        """Stop (or resume) sending new requests to the replica; True if this call changed it."""

    def inflight(self, name: str) -> int:
        """Requests this gateway has in flight on the replica (0 once it is gone)."""

    def remove(self, name: str) -> None:
        """Take the replica out of the pool (its prefix index and load watchers go with it)."""


@dataclass(slots=True)
class _Member:
    ep: Endpoint
    name: str
    drained_here: bool = False  # this reconciler drained it (an operator's drain is left alone)
    retire: asyncio.Task[None] | None = None


class Reconciler:
    """Keeps a pool's discovered replicas equal to the latest endpoint set, draining before removing."""

    def __init__(self, membership: Membership, drain_timeout_s: float) -> None:
        self.membership = membership
        self.drain_timeout_s = drain_timeout_s
        self._members: dict[str, _Member] = {}  # source key (e.g. pod uid) -> replica
        self._retiring: list[_Member] = []  # left, draining, not yet removed

    def sync(self, wanted: dict[str, Endpoint]) -> None:
        """Make the pool serve exactly `wanted` (source key -> endpoint); no await, applied at once."""
        for key, member in list(self._members.items()):
            ep = wanted.get(key)
            if ep == member.ep:
                continue
            del self._members[key]
            self._start_retire(member, "left" if ep is None else "changed")
        for key, ep in wanted.items():
            if key in self._members:
                continue
            back = next((m for m in self._retiring if m.ep == ep), None)
            if back is not None:  # ready again before its drain ended: keep its cache and index
                self._retiring.remove(back)
                if back.retire is not None:
                    back.retire.cancel()
                    back.retire = None
                if back.drained_here:
                    self.membership.set_draining(back.name, False)
                    back.drained_here = False
                self._members[key] = back
                log.info("pool %s: replica %s is back (%s)", self.membership.pool, back.name, ep.url)
                continue
            try:
                name = self.membership.add(ep)
            except ValueError as exc:
                log.warning("pool %s: endpoint %s not added: %s", self.membership.pool, ep.url, exc)
                continue
            self._members[key] = _Member(ep, name)

    def names(self) -> dict[str, str]:
        """Source key -> replica name of the replicas serving now (not the draining ones)."""
        return {key: m.name for key, m in self._members.items()}

    def _start_retire(self, member: _Member, why: str) -> None:
        member.drained_here = self.membership.set_draining(member.name, True)
        log.info("pool %s: replica %s %s, draining", self.membership.pool, member.name, why)
        self._retiring.append(member)
        member.retire = asyncio.create_task(self._retire(member), name=f"retire {member.name}")

    async def _retire(self, member: _Member) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        # In-flight counts fall in `Lease.release`, on the request path, which has no hook to wake
        # a waiter; a few looks a second at one integer cost nothing.
        while self.membership.inflight(member.name) > 0 and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(IDLE_POLL_S)
        left = self.membership.inflight(member.name)
        if left:
            log.warning(
                "pool %s: replica %s removed with %d requests still in flight (drain_timeout_s)",
                self.membership.pool,
                member.name,
                left,
            )
        self._retiring.remove(member)
        self.membership.remove(member.name)

    async def close(self) -> None:
        """Stop draining; the replicas stay in the pool (the gateway is stopping)."""
        tasks = [m.retire for m in self._retiring if m.retire is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Registry(Protocol):
    """Where replicas join and leave (gateway.fleet.fleet.Fleet): the calls the admin API and the
    launcher use too."""

    def replicas(self) -> list[Replica]: ...

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
    ) -> Replica: ...

    def unregister(self, pool: Pool, name: str) -> Replica | None: ...


class PoolMembership:
    """`Membership` over one pool of a running gateway's fleet."""

    def __init__(self, registry: Registry, pool: Pool) -> None:
        self.registry = registry
        self._pool = pool
        self.pool = pool.name

    def add(self, ep: Endpoint) -> str:
        # Replica names key the load scraper across pools: a name taken anywhere gets a suffix.
        taken = {r.name for r in self.registry.replicas()}
        name, n = ep.name, 1
        while name in taken:
            n += 1
            name = f"{ep.name}-{n}"
        replica = self.registry.register(
            self._pool,
            ep.url,
            name,
            ep.role,
            ep.kind,
            ep.bootstrap_port,
            managed=True,  # its membership is the gateway's business: reloads and the admin API leave it
            # Topic "" subscribes to every topic the pod's publisher uses.
            kv_events=(
                KVEventsSource(endpoint=ep.kv_events, replay_endpoint=ep.kv_events_replay)
                if ep.kv_events
                else None
            ),
        )
        return replica.name

    def set_draining(self, name: str, draining: bool) -> bool:
        replica = self._pool.replicas.get(name)
        if replica is None or replica.draining == draining:
            return False
        replica.draining = draining
        return True

    def inflight(self, name: str) -> int:
        replica = self._pool.replicas.get(name)
        return replica.inflight_requests if replica is not None else 0

    def remove(self, name: str) -> None:
        if self.registry.unregister(self._pool, name) is not None:
            log.info("pool %s: replica %s removed (discovery)", self.pool, name)
