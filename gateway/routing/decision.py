"""One request's routing decision: the replicas ranked for it, and what its policy hears of it.

`PoolRouter.route` makes it once per request: the candidates ranked best first (whole requests, or
a prefill/decode pool's decode legs) and, in a prefill/decode pool, the prefill candidates. Whoever
carries the request out (the proxy's attempts, or an Envoy gateway through the Endpoint Picker)
reports back through it: `sent` for each attempt (the replica learns the prompt's blocks at once,
so concurrent requests with the same new prefix see where the first went, and the policy hears
`on_routed`), `first_token` once, and `ended` exactly once, however the request ended: a second
call does nothing, so every path may settle it. A continuation of a broken answer is ranked again
(`rerank`) on its own prompt, which holds the original's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.prompt.endpoints import Endpoint
from gateway.routing.policy import Candidate, Outcome, Policy, RequestFeatures

log = logging.getLogger(__name__)


class Router(Protocol):
    """What a decision asks of the pool's router (gateway.routing.pool_router.PoolRouter)."""

    @property
    def pool(self) -> Pool: ...
    @property
    def name(self) -> str: ...
    @property
    def policy(self) -> Policy[Any]: ...
    def features(
        self, body: Mapping[str, Any], endpoint: Endpoint, request_id: str, headers: Mapping[str, str]
    ) -> RequestFeatures: ...
    def rank(self, features: RequestFeatures) -> list[Candidate]: ...
    def learn(self, features: RequestFeatures, replica: Replica, prefill_leg: bool = False) -> None: ...


def overrides(policy: Policy[Any], hook: str) -> bool:
    """Whether `policy` defines the hook itself, rather than inheriting Policy's, which does nothing."""
    return getattr(getattr(policy, hook), "__func__", None) is not getattr(Policy, hook)


class Decision:
    __slots__ = (
        "_ended",
        "_first",
        "attempts",
        "features",
        "prefill",
        "prefills",
        "ranked",
        "replica",
        "router",
    )

    def __init__(
        self,
        router: Router,
        features: RequestFeatures,
        ranked: list[Candidate],
        prefills: list[Candidate],
    ) -> None:
        self.router = router
        self.features = features
        self.ranked = ranked  # best first: whole requests, or the decode legs of a prefill/decode pool
        self.prefills = prefills  # a prefill/decode pool's prefill candidates, best first (else empty)
        self.replica: Replica | None = None  # the (decode) replica that last took the request
        self.prefill: str | None = None  # the replica that ran its prefill leg, if one did
        self.attempts = 0
        self._first = False
        self._ended = False

    @property
    def pool(self) -> str:
        return self.router.name

    def replica_of(self, candidate: Candidate) -> Replica | None:
        """The pool's replica a ranked candidate names; None when it left the pool since."""
        # Keyed by name: the gateway's own replica without casting back the read-only view a
        # policy saw, and plugins need no generics to return what they got.
        return self.router.pool.replicas.get(candidate.replica.name)

    def reason(self, chosen: Candidate) -> str | None:
        """How a prefix-aware choice relates to the cache: `cold` when no replica held any of the
        prompt, `cache_hit` when the chosen one held the most, `spill` when a warmer one was passed
        over (its queue made it slower, or it failed). None for a policy that does not match prefixes."""
        if not self.router.policy.uses_prefix_match:
            return None
        best = max(c.matched_tokens for c in self.ranked)
        if best == 0:
            return "cold"
        return "cache_hit" if chosen.matched_tokens == best else "spill"

    # -- what the policy hears --------------------------------------------------------------
    def sent(self, replica: Replica, features: RequestFeatures | None = None) -> None:
        """An attempt went to `replica` (with `features`, a continuation's own: the original's by
        default); it holds the prompt's blocks from now on."""
        self.replica = replica
        self.attempts += 1
        self.router.learn(features or self.features, replica)

    def sent_prefill(self, replica: Replica, features: RequestFeatures | None = None) -> None:
        """A prefill leg went to `replica`: it will hold the prompt's blocks. Not the request's
        route: the policy hears `on_routed` for its decode replica only."""
        self.router.learn(features or self.features, replica, prefill_leg=True)

    @property
    def hears_first_token(self) -> bool:
        """Whether the policy has an `on_first_token` of its own (the base class's does nothing, so
        a stream need not call it)."""
        return overrides(self.router.policy, "on_first_token")

    def first_token(self, replica: Replica) -> None:
        """The answer's first token came from `replica`: the policy hears of it, once. A hook
        that fails is logged: the stream goes on."""
        if self._first:
            return
        self._first = True
        policy = self.router.policy
        try:
            policy.on_first_token(self.features, replica)
        except Exception:
            log.exception(
                "pool %s: %s.on_first_token failed for request %s",
                self.pool,
                type(policy).__qualname__,
                self.features.request_id,
            )

    def ended(
        self,
        status: int | None,
        error: str | None,
        ttft_s: float | None,
        e2e_s: float,
        prompt_tokens: int | None,
        cached_tokens: int | None,
    ) -> None:
        """The request ended: the policy hears how, exactly once (later calls do nothing). A hook
        that fails is logged: the answer, often sent already, is not the plugin's to change."""
        if self._ended:
            return
        self._ended = True
        policy = self.router.policy
        if not overrides(policy, "on_complete"):
            return  # the base class's hook does nothing: no Outcome to build
        outcome = Outcome(
            ok=error is None,
            status=status,
            error=error,
            ttft_s=ttft_s,
            e2e_s=e2e_s,
            prompt_tokens=prompt_tokens or self.features.prompt_tokens,
            cached_tokens=cached_tokens,
            attempts=self.attempts,
            prefill_replica=self.prefill,
        )
        try:
            policy.on_complete(self.features, self.replica, outcome)
        except Exception:
            log.exception(
                "pool %s: %s.on_complete failed for request %s",
                self.pool,
                type(policy).__qualname__,
                self.features.request_id,
            )

    # -- a continuation -----------------------------------------------------------------------
    def rerank(
        self,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        headers: Mapping[str, str],
        without: str | None = None,
    ) -> tuple[RequestFeatures, list[Candidate]]:
        """A continuation's features and ranking (its prompt holds the original's), `without` the
        replica named, which broke the answer."""
        router = self.router
        features = router.features(body, endpoint, self.features.request_id, headers)
        ranked = [c for c in router.rank(features) if c.replica.name != without]
        return features, ranked
