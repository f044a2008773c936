"""The state backend interface, and the local counters every backend falls back on."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.admission.limits import Bucket, LocalBuckets
from gateway.config import StateConfig

if TYPE_CHECKING:
    from gateway.fleet.fleet import Fleet
    from gateway.routing.prefix_index import PrefixIndex
    from gateway.routing.rollout import Router


class LocalCounters:
    """Fixed-window counters in this process (the memory backend, and Redis' fallback when down)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counts: dict[tuple[str, float], tuple[int, int]] = {}  # (key, window_s) -> (window, count)

    def incr(self, key: str, amount: int, window_s: float) -> int:
        window = int(self._clock() // window_s)
        current, count = self._counts.get((key, window_s), (window, 0))
        count = count + amount if current == window else amount
        self._counts[(key, window_s)] = (window, count)
        return count


class StateBackend:
    """What a gateway shares with its peers. Subclasses override what they share.

    - in-flight load: each instance's own stays in `Replica.inflight_*`; the others' arrives in
      `Replica.remote_inflight_*` (policies add the two).
    - prefix index: blocks one instance learns reach the other instances' prefix indexes, for
      each index the composition root hands to `share_index`.
    - route weights: `publish_weights` after a local change reaches every instance's router.
    - drain: `publish_drain` after a local change reaches every instance's replica.
    - endpoints: `publish_endpoint` after an admin API add or remove makes every instance do it.
    - rate limits: `take` charges fleet-wide token buckets atomically; `incr` is an exact
      fleet-wide fixed-window counter.
    """

    name: ClassVar[str] = "base"

    def __init__(self, cfg: StateConfig, fleet: Fleet, router: Router) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.router = router
        self.counters = LocalCounters()
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

    async def incr(self, key: str, amount: int, window_s: float) -> int:
        """Add `amount` to counter `key` in the current `window_s`-second window; the window's total.

        Fleet-wide and exact with a shared backend (one round trip); local otherwise.
        """
        return self.counters.incr(key, amount, window_s)

    async def take(self, charges: Sequence[Bucket]) -> list[float]:
        """Charge every bucket at once if each can pay, else none: per bucket, the seconds until the
        same charge would pass (all 0.0: charged). Fleet-wide and atomic with a shared backend."""
        return self.buckets.take(charges)

    def status(self) -> dict[str, Any]:
        return {"backend": self.name, "connected": self.connected}
