"""prefix_affinity: send each request where its first token is expected soonest.

For every candidate replica the policy estimates the request's time to first token:

    queued prefill work ahead of it           max(own in-flight uncached tokens, engine waiting x cost)
  + the part of this prompt it must compute   prompt_tokens - matched_tokens on that replica
  all divided by the prefill throughput, plus a per-request term for every request in flight there
  (per-request overheads and the decode steps a prefill shares its batches with).

The lowest estimate wins. A warm replica therefore keeps a prefix while its queue is shorter than
the cost of recomputing the prefix elsewhere, and a hot prefix spills onto a second replica exactly
when that is faster: affinity degrades smoothly under load instead of flipping to shortest-queue.

Load is counted from two sources: the policy's own ledger of the uncached tokens it sent to each
replica, updated at decision time (exact and current; entries leave it as the replica's in-flight
request count falls, oldest first), and the engine's own waiting queue while its scrape is fresh
(it also sees other gateways' traffic). The larger one is taken, so neither double counts our own
requests nor misses anyone else's.

Requests no replica has an advantage for (no hit anywhere, or the same hit everywhere) go to the
replica among the near-cheapest that received such a request least recently, so new prefixes
spread evenly instead of piling onto whichever replica looked idle first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import Candidate, Policy, ReplicaView, RequestFeatures


class PrefixAffinityParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill_tokens_per_s: float = Field(
        30000.0, gt=0, description="Prefill throughput of one replica (wall clock; scale by the sim speedup)"
    )
    per_request_s: float = Field(
        0.004,
        ge=0,
        description="Added per request in flight on the replica (overheads, shared decode steps)",
    )
    waiting_token_cost: int = Field(
        1024, ge=0, description="Uncached tokens assumed per request in the engine's own waiting queue"
    )
    cold_spread_s: float = Field(
        0.05,
        ge=0,
        description="Requests without a preferred replica may go to any replica this close to the best, "
        "picking the one that got such a request least recently",
    )


class PrefixAffinity(Policy):
    Params = PrefixAffinityParams
    uses_prefix_match = True

    def __init__(self, params: BaseModel) -> None:
        super().__init__(params)
        p: PrefixAffinityParams = params  # type: ignore[assignment]
        self._tps = p.prefill_tokens_per_s
        self._per_request = p.per_request_s
        self._waiting_cost = p.waiting_token_cost
        self._spread = p.cold_spread_s
        # replica -> request id -> uncached tokens sent there, oldest first
        self._ledger: dict[str, OrderedDict[str, int]] = {}
        self._ledger_tokens: dict[str, int] = {}
        self._placed: dict[str, str] = {}  # request id -> replica its ledger entry is on
        self._cold_stamp: dict[str, int] = {}  # replica -> when it last took a request without a preference
        self._cold_clock = 0

    def queued_tokens(self, r: ReplicaView) -> int:
        """Uncached prompt tokens believed queued on `r`: our ledger or the engine's queue, the larger."""
        name = r.name
        ledger = self._ledger.get(name)
        own = 0
        if ledger is not None:
            # Finished requests leave the replica's in-flight count; drop as many entries, oldest first.
            excess = len(ledger) - r.inflight_requests
            if excess > 0:
                tokens = self._ledger_tokens[name]
                for _ in range(excess):
                    rid, n = ledger.popitem(last=False)
                    tokens -= n
                    if self._placed.get(rid) == name:
                        del self._placed[rid]
                self._ledger_tokens[name] = tokens
            own = self._ledger_tokens[name]
        if r.engine_fresh:
            return max(own, r.engine.waiting * self._waiting_cost)
        return own

    def estimate_s(self, request: RequestFeatures, c: Candidate) -> float:
        """The estimated time to first token of `request` on candidate `c`, in seconds."""
        r = c.replica
        uncached = max(0, request.prompt_tokens - c.matched_tokens)
        in_flight = max(r.inflight_requests, r.engine.running + r.engine.waiting if r.engine_fresh else 0)
        return (self.queued_tokens(r) + uncached) / self._tps + self._per_request * in_flight

    async def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        if not candidates:
            return []
        scored = sorted(
            ((self.estimate_s(request, c), c.replica.inflight_requests, i) for i, c in enumerate(candidates)),
        )
        best = scored[0]
        matched = [c.matched_tokens for c in candidates]
        if max(matched) == min(matched):
            # No replica is preferred for its cache: among the near-cheapest, the one that took
            # such a request least recently (llm-d's no-hit-LRU), so new prefixes spread evenly.
            limit = best[0] + self._spread
            stamp = self._cold_stamp
            best = min(
                (s for s in scored if s[0] <= limit),
                key=lambda s: (stamp.get(candidates[s[2]].replica.name, -1), s[0]),
            )
            self._cold_clock += 1
            stamp[candidates[best[2]].replica.name] = self._cold_clock
        chosen = candidates[best[2]]
        self._charge(request.request_id, chosen.replica.name, request.prompt_tokens - chosen.matched_tokens)
        return [chosen, *(candidates[s[2]] for s in scored if s is not best)]

    def _charge(self, request_id: str, replica: str, tokens: int) -> None:
        old = self._placed.get(request_id)
        if old is not None:
            self._ledger_tokens[old] -= self._ledger[old].pop(request_id)
        ledger = self._ledger.get(replica)
        if ledger is None:
            ledger = self._ledger[replica] = OrderedDict()
            self._ledger_tokens[replica] = 0
        ledger[request_id] = tokens
        self._ledger_tokens[replica] += tokens
        self._placed[request_id] = replica

    def on_routed(self, request: RequestFeatures, replica: ReplicaView) -> None:
        # A retry may have sent the request past the replica it was charged to: move the charge.
        placed = self._placed.get(request.request_id)
        if placed is not None and placed != replica.name:
            tokens = self._ledger[placed][request.request_id]
            self._charge(request.request_id, replica.name, tokens)
