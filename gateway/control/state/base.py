"""The state backend interface, and the local rate-limit buckets every backend falls back on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.admission.limits import Bucket, LocalBuckets
from gateway.config import StateConfig

if TYPE_CHECKING:
    from gateway.fleet.fleet import Fleet
    from gateway.routing.prefix_index import PrefixIndex
    from gateway.routing.rollout import Rollouts


class StateBackend:
    """What a gateway shares with its peers. Subclasses override what they share.

    - in-flight load: each instance's own stays in `Replica.inflight_*`; the others' arrives in
      `Replica.remote_inflight_*` (policies add the two).
    - prefix index: blocks one instance learns reach the other instances' prefix indexes, for
      each index the composition root hands to `share_index`.
    - route weights: `publish_weights` after a local change reaches every instance's router.
    - drain: `publish_drain` after a local change reaches every instance's replica.
    - endpoints: `publish_endpoint` after an admin API add or remove makes every instance do it.
    - rate limits: `take` charges fleet-wide token buckets atomically.
    """

    name: ClassVar[str] = "base"

    def __init__(self, cfg: StateConfig, fleet: Fleet, router: Rollouts) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.router = router
        self.buckets = LocalBuckets()

    @property
    def connected(self) -> bool:
        """False while the shared store is unreachable (the gateway then serves from local state)."""
        return True

    def share_index(self, pool: str, index: PrefixIndex) -> PrefixIndex:
        """The index to route `pool` with: `index` itself, or one that shares what it learns."""
        return index

    async def start(self) -> None:
        """Called once from Runtime.start."""

    async def stop(self) -> None:
        """Called once from Runtime.stop."""

    async def publish_weights(
        self, model: str, rule_index: int, weights: Mapping[str, float], who: str
    ) -> None:
        """The local router's rule now has these weights; make every instance use them."""

    async def publish_routes(self, who: str) -> None:
        """The routes were reloaded from the config file: their weights become the fleet's."""

    async def publish_drain(self, pool: str, url: str, draining: bool, who: str) -> None:
        """A replica was drained or undrained here; make every instance do the same."""

    async def publish_endpoint(self, pool: str, url: str, endpoint: dict[str, Any] | None, who: str) -> None:
        """An unmanaged replica was added here (its EndpointConfig fields) or removed (None); make every
        instance do the same."""

    async def take(self, charges: Sequence[Bucket]) -> list[float]:
        """Charge every bucket at once if each can pay, else none: per bucket, the seconds until the
        same charge would pass (all 0.0: charged). Fleet-wide and atomic with a shared backend."""
        return self.buckets.take(charges)

    def status(self) -> dict[str, Any]:
        return {"backend": self.name, "connected": self.connected}
