"""prefix_affinity: send each request where its first token is expected soonest.

For every candidate replica the policy estimates the request's time to first token, in tokens of
prefill work (divide by the prefill throughput for seconds):

    prefill work queued there        max(own queue estimate, the engine's waiting queue)
  + this prompt's uncached part      prompt_tokens - matched_tokens on that replica
  + a decode-load term               per_request_tokens x requests in flight there (ours, other
                                     gateways' from shared state, or the engine's count if larger)

(the first and last summed over the replicas that share its GPU, `device`: they queue for one device)

The lowest estimate wins, after a surcharge of `duplicate_weight` per prefix token a candidate would
recompute although another candidate holds it: a second copy costs KV space that evicts other
prefixes later. A warm replica therefore keeps a prefix while its queue is shorter than the cost of
recomputing the prefix elsewhere, and a hot prefix spills onto a second replica when that is
clearly faster: affinity degrades smoothly under load instead of flipping to shortest-queue.

Load comes from two sources. The policy's own queue estimate is charged at decision time with the
uncached tokens it sends to a replica. A streamed request's tokens stay queued until its first
token comes (`on_first_token`): engines prefill first come, first served, so of the streams
awaiting their first token only the oldest can be partly done, credited `prefill_tokens_per_s`
times the time since it could start (its send, or the replica's latest first token), and the
others wait whole. A drain rate cannot stand in for that: a 16k-32k-token document prefills
slower per token than short prompts, and with every queued token drained at one rate a replica
still prefilling documents looked nearly free (the simulator's queue held 20-28k tokens where the
estimate had 1-3k), so chats and the next document queued behind them (routing-long: mean time to
first token 1.07-1.66x radix_cache_aware's before; 0.99-1.02x with this and the speeds below).
Requests whose first token is not heard (not streamed) drain at the rate (a request's prefill is
over long before its decode is), capped by the uncached tokens of those still in flight (an entry
leaves that ledger when its request completes, however it ends). The
engine's own waiting queue, while its scrape is fresh, also sees admission stalls and other
gateways' traffic: its requests are costed at the average uncached size of ours queued there,
those beyond our count in flight there at `waiting_token_cost`. The larger of the two estimates
counts, so neither double counts our own requests nor misses anyone else's.

Replicas differ (an H100 beside an H200, a GPU shared by several engines): with `measured_speed`
each replica's pace is the measured replicas' mean prefill rate (`ReplicaView.speed`, fitted by the
gateway from its requests' time to first token against their uncached tokens) times its speed
relative to theirs on prompts of like size (`relative_prefill_speeds`); its queue drains at that
pace and its estimate is scaled by the mean over it, so work on a replica half as fast counts
twice. Compared overall instead, a replica that served documents read twice as fast as one serving
chats on the same GPU (per-request overheads weigh on short prompts) and drew the next documents.
A replica not measured yet counts at the mean (the parameter only while none is measured).

A replica whose engine offloads KV to CPU memory (`Candidate.cpu_matched_tokens`, the prefix tokens it
holds there past those on its GPU) loads them instead of recomputing them: with `cpu_tier` they
cost `prefill rate / load rate` of a token each. The load rate (tokens/s copied from CPU) is learned
from streamed requests that had such tokens: the time from when their prefill could start to their
first token, less their uncached tokens at the replica's prefill rate, is what loading took
(a ratio of decayed sums, from `cpu_load_tokens_per_s` as a prior worth one request of 4k tokens;
each sample held between half the prefill rate and 100 times it). Without `cpu_tier` the tokens
count as uncached: the tier ignored, as the GPU-only rule routes.

Requests no replica has an advantage for (no hit anywhere, or the same hit everywhere) go to the
replica, among those within `cold_spread_tokens` of the best, that was given the fewest such
requests lately (a count decaying with `placement_window_s`): new prefixes are dealt out evenly,
and a replica skipped while it was busy is given the next ones.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import (
    Candidate,
    LoadScorer,
    Outcome,
    Policy,
    ReplicaView,
    RequestFeatures,
    per_device,
    relative_prefill_speeds,
)

# How long replicas' relative speeds are reused between decisions.
RELATIVE_TTL_S = 1.0
# The learned CPU load rate: the prior's weight in tokens, each sample's decay, and a sample's bounds
# as multiples of the prefill rate (a load faster than 100x is within the noise of a time to first token).
LOAD_PRIOR_TOKENS = 4096.0
LOAD_DECAY = 0.9
LOAD_BOUNDS = (0.5, 100.0)


class PrefixAffinityParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill_tokens_per_s: float = Field(
        30000.0,
        gt=0,
        description="How fast one replica works through queued prefill (wall clock: multiply by a "
        "simulator's speedup); the oldest stream awaiting its first token is credited this much "
        "progress, and requests not streamed drain from the queue estimate at this rate",
    )
    # Each decoding sequence adds ~0.1 ms to an 8B step on an H200 (a few tokens of prefill for
    # the step or two a newcomer waits); 32 also weighs the slower decode it will share, and still
    # lets a hot prefix spill once its replica carries ~100 more requests than another. At 128,
    # ordinary fluctuations of in-flight counts (20-30 requests) spilled one-off requests of
    # shared-prefix groups into cold recomputes (p95 1.38x radix_cache_aware's above capacity).
    per_request_tokens: float = Field(
        32.0,
        ge=0,
        description="Decode-load term: tokens of prefill work each request in flight on a replica is worth "
        "(its share of every batch step, and the slower decode a newcomer shares)",
    )
    duplicate_weight: float = Field(
        0.5,
        ge=0,
        description="Extra weight on recomputing prefix tokens another candidate already holds: a second "
        "copy takes KV space that will evict other prefixes",
    )
    waiting_token_cost: int = Field(
        1024,
        ge=0,
        description="Uncached tokens assumed per request waiting in the engine beyond the policy's own",
    )
    cold_spread_tokens: float = Field(
        2048.0,
        ge=0,
        description="Requests without a preferred replica may go to any replica this close to the best; "
        "the one given the fewest such requests lately wins",
    )
    placement_window_s: float = Field(
        600.0, gt=0, description="Time constant of the count of new prefixes given to each replica"
    )
    device_load: bool = Field(
        True,
        description="Count queued prefill and decode load over every replica on the same device (replicas "
        "sharing a GPU): moving work among them frees nothing. No effect on replicas without a device",
    )
    cpu_tier: bool = Field(
        True,
        description="Credit prefix tokens a replica holds in CPU memory (Candidate.cpu_matched_tokens) "
        "at the learned load rate; false: count them as uncached (the tier ignored)",
    )
    cpu_load_tokens_per_s: float = Field(
        400000.0,
        gt=0,
        description="Prior for the rate at which a replica loads prefix tokens from CPU memory (wall clock: "
        "multiply by a simulator's speedup), until learned from time to first token",
    )
    measured_speed: bool = Field(
        True,
        description="Use each replica's measured prefill rate (ReplicaView.speed) where known (one not "
        "measured yet: the measured ones' mean): its queue drains at that rate and its estimate is "
        "scaled by the fleet's mean rate over its own",
    )


@dataclass(slots=True)
class _Queue:
    """The policy's own view of one replica's prefill queue."""

    # Streamed requests sent here whose first token has not come yet, in the order they were sent:
    # id -> (uncached tokens, when sent). Engines prefill first come, first served, so all but the
    # oldest are still queued whole.
    streams: OrderedDict[str, tuple[int, float]] = field(default_factory=OrderedDict)
    stream_tokens: int = 0
    first_at: float = 0.0  # when the latest first token came from this replica
    # Other requests in flight (no first token is heard for them): id -> uncached tokens.
    ledger: OrderedDict[str, int] = field(default_factory=OrderedDict)
    ledger_tokens: int = 0
    backlog: float = 0.0  # uncached ledger tokens not yet prefilled, as of `stamp`
    stamp: float = 0.0
    placements: float = 0.0  # requests without a preference given to it, decaying, as of `placed_at`
    rate: float = 0.0  # prefill tokens/s it drains at, as last known (0: the parameter)
    placed_at: float = 0.0


class PrefixAffinity(Policy[PrefixAffinityParams]):
    uses_prefix_match = True

    def __init__(self, params: PrefixAffinityParams, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(params)
        p = params
        self._load = LoadScorer(p.waiting_token_cost)
        self._tps = p.prefill_tokens_per_s
        self._per_request = p.per_request_tokens
        self._duplicate = p.duplicate_weight
        self._waiting_cost = p.waiting_token_cost
        self._spread = p.cold_spread_tokens
        self._clock = clock
        self._queues: dict[str, _Queue] = {}
        self._placed: dict[str, tuple[str, int]] = {}  # request id -> (replica charged, tokens)
        self._window = p.placement_window_s
        self._device_load = p.device_load
        self._measured = p.measured_speed
        self._relative_speeds: dict[str, float | None] = {}
        self._relative_at = -math.inf
        self._cpu_tier = p.cpu_tier
        # The load rate as decayed sums of tokens loaded and the seconds they took.
        self._load_tokens = LOAD_PRIOR_TOKENS
        self._load_seconds = LOAD_PRIOR_TOKENS / p.cpu_load_tokens_per_s
        self._loading: dict[str, tuple[int, int]] = {}  # stream id -> (CPU tokens, uncached tokens)

    @property
    def load_tokens_per_s(self) -> float:
        """The rate at which replicas load prefix tokens from CPU memory, as learned."""
        return self._load_tokens / self._load_seconds

    def _rates(self, candidates: Sequence[Candidate]) -> list[float]:
        """The candidates' prefill tokens/s: the measured ones' mean rate, times each one's speed
        relative to the others on requests of like size (`relative_prefill_speeds`). Overall
        rates depend on the mix a replica served: one that prefilled documents read twice as fast
        as one serving chats on the same GPU (6.6k against 3.5k tokens/s) and drew the next
        documents, queued behind each other (routing-long --quick). One not measured yet counts
        at the mean, not at the parameter: a replica is measured once 8 of its requests have
        ended, one serving documents ends few, and taken at 10k tokens/s beside replicas measured
        at 6-7k it looked 1.5x faster and drew 11 of 22 documents (routing-long). The parameter
        applies while none is measured."""
        measured = [c.replica.speed.prefill_tokens_per_s for c in candidates]
        known = [rate for rate in measured if rate is not None]
        if not known:
            return [self._tps] * len(candidates)
        mean = sum(known) / len(known)
        relative = self._relative(candidates)
        return [mean * (relative.get(c.replica.name) or 1.0) for c in candidates]

    def _relative(self, candidates: Sequence[Candidate]) -> dict[str, float | None]:
        """`relative_prefill_speeds` by replica name, recomputed at most every RELATIVE_TTL_S: it
        goes over every size class of every candidate, and the rates it compares average about the
        last 20 requests anyway. A replica it lacks counts 1.0 until then."""
        now = self._clock()
        if now - self._relative_at >= RELATIVE_TTL_S:
            self._relative_speeds = dict(
                zip((c.replica.name for c in candidates), relative_prefill_speeds(candidates), strict=True)
            )
            self._relative_at = now
        return self._relative_speeds

    def _queue(self, name: str, now: float, rate: float | None = None) -> _Queue:
        """The replica's queue estimate, drained up to `now` at `rate` (default: as last known)."""
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue(stamp=now)
        elif q.backlog:
            q.backlog = max(0.0, q.backlog - (now - q.stamp) * (rate or q.rate or self._tps))
        q.stamp = now
        return q

    @staticmethod
    def _own(q: _Queue, rate: float, now: float) -> float:
        """The uncached tokens of our requests still to prefill on the replica: the ledger's drained
        backlog, and the streams awaiting their first token, less what the oldest of them got done
        since it could start (its send, or the replica's latest first token)."""
        own = min(q.backlog, q.ledger_tokens)
        if q.streams:
            tokens, sent = next(iter(q.streams.values()))
            started = sent if sent > q.first_at else q.first_at
            own += q.stream_tokens - min(tokens, rate * (now - started))
        return own

    def _queued(self, q: _Queue, r: ReplicaView, fresh: bool, rate: float, now: float) -> float:
        own = self._own(q, rate, now)
        if fresh and r.engine.waiting:
            # Waiting requests cost what ours queued there cost on average; any beyond our count
            # in flight are another gateway's, of unknown size. A stream past its first token is
            # still ours: a scrape a moment old counts it waiting.
            waiting = r.engine.waiting
            mine = len(q.ledger) + len(q.streams)
            tokens = q.ledger_tokens + q.stream_tokens
            engine = min(waiting, mine) * (tokens / mine if mine else 0.0)
            engine += max(0, waiting - max(mine, r.inflight_requests)) * self._waiting_cost
            return max(own, engine)
        return own

    def queued_tokens(self, r: ReplicaView, now: float | None = None) -> float:
        """Uncached prompt tokens believed queued for prefill on `r`."""
        now = self._clock() if now is None else now
        q = self._queue(r.name, now)  # at the pace the last decision took for it
        return self._queued(q, r, r.engine_fresh, q.rate or self._tps, now)

    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        if not candidates:
            return []
        now = self._clock()
        # The module docstring's estimate, per candidate, in one pass (this runs on every request).
        queues, queued, tps, in_flight = self._queues, self._queued, self._tps, self._load.requests
        per_request, duplicate, prompt = self._per_request, self._duplicate, request.prompt_tokens
        # Tokens each candidate need not recompute: on its GPU, and (`cpu_tier`) in its CPU memory.
        cpu = [c.cpu_matched_tokens for c in candidates] if self._cpu_tier else [0] * len(candidates)
        matches = [c.matched_tokens + k for c, k in zip(candidates, cpu, strict=True)]
        deepest = max(matches)
        cold = deepest == min(matches)
        load_rate = self.load_tokens_per_s
        # A slower replica's work takes longer: estimates are in tokens at the fleet's mean rate.
        rates = self._rates(candidates) if self._measured else None
        if rates and self._device_load:
            # Replicas on one GPU prefill at the device's pace, whichever was measured busier.
            counts = per_device(candidates, [1.0] * len(candidates))
            rates = [total / n for total, n in zip(per_device(candidates, rates), counts, strict=True)]
        mean_rate = sum(rates) / len(rates) if rates else tps
        # The work each replica has before this prompt: queued prefill and the decode-load term,
        # taken over the whole GPU when replicas share one (`device_load`).
        work = []
        for i, c in enumerate(candidates):
            r = c.replica
            rate = rates[i] if rates else tps
            q = queues.get(r.name)
            if q is None:
                q = self._queue(r.name, now)
            elif q.backlog:
                q.backlog = max(0.0, q.backlog - (now - q.stamp) * rate)
                q.stamp = now
            q.rate = rate
            fresh = r.engine_fresh
            ahead = queued(q, r, fresh, rate, now) if fresh else self._own(q, rate, now)
            work.append(ahead + per_request * in_flight(r, fresh))
        if self._device_load:
            work = per_device(candidates, work)
        scored = []
        charges = []
        for i, c in enumerate(candidates):
            uncached = prompt - matches[i]
            # Loading a CPU-resident token takes prefill rate / load rate of a recomputed one's time.
            own = (uncached if uncached > 0 else 0) + cpu[i] * (rates[i] if rates else tps) / load_rate
            charges.append(own)
            cost = work[i] + own
            if rates and rates[i] != mean_rate:
                cost *= mean_rate / rates[i]
            scored.append((cost + duplicate * (deepest - matches[i]), c.replica.inflight_requests, i))
        scored.sort()
        best = scored[0]
        if cold:
            # No replica is preferred for its cache: among the near-cheapest, the one given the
            # fewest such requests lately (per unit of its measured speed), so new prefixes are
            # dealt out evenly, or in proportion to speed.
            limit = best[0] + self._spread
            queues = self._queues

            def dealt(s: tuple[float, int, int]) -> tuple[float, float]:
                q = queues[candidates[s[2]].replica.name]
                return self.placements(q, now) / (rates[s[2]] if rates else 1.0), s[0]

            best = min((s for s in scored if s[0] <= limit), key=dealt)
            q = queues[candidates[best[2]].replica.name]
            q.placements = self.placements(q, now) + 1.0
            q.placed_at = now
        chosen = candidates[best[2]]
        self._charge(request, chosen.replica.name, round(charges[best[2]]), now)
        if cpu[best[2]] and request.stream:
            self._loading[request.request_id] = (cpu[best[2]], max(0, prompt - matches[best[2]]))
        else:
            self._loading.pop(request.request_id, None)
        return [chosen, *(candidates[s[2]] for s in scored if s is not best)]

    def placements(self, q: _Queue, now: float) -> float:
        return q.placements * math.exp((q.placed_at - now) / self._window)

    def _charge(self, request: RequestFeatures, replica: str, tokens: int, now: float) -> None:
        request_id = request.request_id
        placed = self._placed.get(request_id)
        if placed is not None:
            old = self._queue(placed[0], now)
            self._waited(old, request_id, placed[1])
            old.backlog = max(0.0, old.backlog - placed[1])
        q = self._queue(replica, now)
        if request.stream:
            q.streams[request_id] = (tokens, now)
            q.stream_tokens += tokens
        else:
            q.ledger[request_id] = tokens
            q.ledger_tokens += tokens
            q.backlog += tokens
        self._placed[request_id] = (replica, tokens)

    @staticmethod
    def _waited(q: _Queue, request_id: str, tokens: int) -> None:
        """The request's uncached tokens no longer wait on `q`'s replica."""
        if q.streams.pop(request_id, None) is not None:
            q.stream_tokens -= tokens
        elif q.ledger.pop(request_id, None) is not None:
            q.ledger_tokens -= tokens

    def on_routed(self, request: RequestFeatures, replica: ReplicaView) -> None:
        # A retry may have sent the request past the replica it was charged to: move the charge.
        placed = self._placed.get(request.request_id)
        if placed is not None and placed[0] != replica.name:
            self._charge(request, replica.name, placed[1], self._clock())
            self._loading.pop(request.request_id, None)  # its CPU tokens were the first replica's

    def on_first_token(self, request: RequestFeatures, replica: ReplicaView) -> None:
        # Its prefill is over, and the next stream sent there starts on its own from now.
        placed = self._placed.get(request.request_id)
        loading = self._loading.pop(request.request_id, None)
        if placed is not None:
            q = self._queues.get(placed[0])
            if q is not None and request.request_id in q.streams:
                now = self._clock()
                if loading is not None:
                    self._learn_load(q, q.streams[request.request_id][1], loading, now)
                self._waited(q, request.request_id, placed[1])
                q.first_at = now

    def _learn_load(self, q: _Queue, sent: float, loading: tuple[int, int], now: float) -> None:
        """A stream whose prefix was partly on CPU got its first token: what its prefill took beyond
        its uncached tokens at the replica's rate is what loading took (module docstring)."""
        tokens, uncached = loading
        rate = q.rate or self._tps
        started = sent if sent > q.first_at else q.first_at
        low, high = LOAD_BOUNDS
        seconds = min(max(now - started - uncached / rate, tokens / (rate * high)), tokens / (rate * low))
        self._load_tokens = LOAD_DECAY * self._load_tokens + tokens
        self._load_seconds = LOAD_DECAY * self._load_seconds + seconds

    def on_complete(self, request: RequestFeatures, replica: ReplicaView | None, outcome: Outcome) -> None:
        # Its uncached tokens no longer wait anywhere (a stream that ended before its first token too).
        self._loading.pop(request.request_id, None)
        placed = self._placed.pop(request.request_id, None)
        if placed is not None:
            q = self._queues.get(placed[0])
            if q is not None:
                self._waited(q, request.request_id, placed[1])
