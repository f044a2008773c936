"""Admission control in front of dispatch: priority classes, shortest-job-first with aging, tenant
fairness, bounded queues that answer 429/503 instead of timing out, and per-tenant limits.

A request is dispatched at once when its pool has headroom and nobody is queued (the fast path: no
queue, no task switch). Otherwise it waits in its pool's queue until a ticket is released, a periodic
re-check finds headroom (engine figures change with every scrape), its queue timeout expires (503), a
higher-class request evicts it from a full queue (429), its client goes away (entry removed at once), or
the gateway shuts down (503 shortly before the grace period ends, so the client can retry elsewhere).

Order of dispatch from a pool's queue:
1. strict priority between classes (higher `level` first); a lower class only runs when every higher
   class is empty, and is bounded by its queue timeout, so starvation ends in a 503, never a hang;
2. inside a class, a request that has waited `aging_s` goes first (oldest first): the aging bound;
3. otherwise the tenant with the fewest tokens served (a virtual token counter, as in VTC fair queuing:
   a tenant returning from idle starts at the current counter, so idleness earns no credit);
4. inside a tenant, the smallest estimated job (uncached prompt tokens + expected output tokens),
   or first come first served when `sjf` is off.

A class may reserve in-flight slots (`reserved_per_replica`) that lower classes never take, so that a
high-priority arrival finds a free slot even when long low-priority jobs fill the fleet: engines do not
preempt a running request for a waiting one, so without a reserve it would wait for one to finish.

Which class a request is in, and whether its prompt fits, is decided before it gets here (the
preparation step, by `classes`, gateway.admission.classes); the scheduler orders and admits only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from gateway.admission.classes import PriorityClasses
from gateway.admission.limits import Clock, Limits, ShedError, Take
from gateway.config import PriorityClass, SchedulerConfig, TenantConfig
from gateway.routing.policy import RequestFeatures

if TYPE_CHECKING:
    from gateway.fleet.replica import Replica
    from gateway.routing.pool_router import PoolRouter

SHED_REASONS = (
    "queue_full",
    "evicted",
    "queue_timeout",
    "rate_limit_requests",
    "rate_limit_tokens",
    "prompt_too_large",
    "shutting_down",
)


# -- the pure queue: ordering and shedding, no I/O, driven by an explicit clock ---------------------------
@dataclass(slots=True, eq=False)
class Entry:
    """One queued request."""

    cost: int
    tenant: str | None
    enqueued: float
    seq: int
    tokens: int = 0  # prompt tokens (the in-flight token budget counts these, like Replica.lease)
    request_id: str = ""
    future: asyncio.Future[Ticket] | None = None
    live: bool = True  # False once popped, removed or evicted; heaps and deques drop dead ones lazily


class ClassQueue:
    """The queue of one priority class in one pool."""

    def __init__(self, cls: PriorityClass, sjf: bool, aging_s: float) -> None:
        self.name = cls.name
        self.level = cls.level
        self.max_queue = cls.max_queue
        self.sjf = sjf
        self.aging_s = aging_s
        self._fifo: deque[Entry] = deque()  # arrival order: aging and eviction of the newest
        self._heaps: dict[str | None, list[tuple[int, int, Entry]]] = {}
        self._live: dict[str | None, int] = {}  # queued entries per tenant
        self._served: dict[str | None, float] = {}  # virtual token counter per tenant
        self._vclock = 0.0  # counter of the tenant served last
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, e: Entry) -> None:
        if not self._live.get(e.tenant):
            # Returning from idle: no credit for the time away.
            self._served[e.tenant] = max(self._served.get(e.tenant, 0.0), self._vclock)
        self._live[e.tenant] = self._live.get(e.tenant, 0) + 1
        key = e.cost if self.sjf else 0
        heapq.heappush(self._heaps.setdefault(e.tenant, []), (key, e.seq, e))
        self._fifo.append(e)
        self.size += 1

    def remove(self, e: Entry) -> None:
        if e.live:
            e.live = False
            self._forget(e)
            self._compact()

    def _forget(self, e: Entry) -> None:
        self.size -= 1
        self._live[e.tenant] -= 1

    def _compact(self) -> None:
        # Lazy deletion keeps removal O(1); rebuild when dead entries outnumber live ones.
        if len(self._fifo) > 64 and len(self._fifo) > 2 * self.size:
            self._fifo = deque(e for e in self._fifo if e.live)
            for tenant, heap in self._heaps.items():
                self._heaps[tenant] = [item for item in heap if item[2].live]
                heapq.heapify(self._heaps[tenant])

    def oldest(self) -> Entry | None:
        while self._fifo and not self._fifo[0].live:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def newest(self) -> Entry | None:
        while self._fifo and not self._fifo[-1].live:
            self._fifo.pop()
        return self._fifo[-1] if self._fifo else None

    def peek(self, now: float) -> Entry | None:
        """The entry `pop(now)` would return."""
        head = self.oldest()
        if head is None or now - head.enqueued >= self.aging_s:
            return head
        tenant = min((t for t, n in self._live.items() if n > 0), key=lambda t: self._served[t])
        heap = self._heaps[tenant]
        while not heap[0][2].live:
            heapq.heappop(heap)
        return heap[0][2]

    def pop(self, now: float) -> Entry | None:
        chosen = self.peek(now)
        if chosen is None:
            return None
        chosen.live = False
        self._forget(chosen)
        served = self._served[chosen.tenant] + chosen.cost
        self._served[chosen.tenant] = served
        self._vclock = served
        return chosen


class QueueFull(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PoolQueue:
    """All classes of one pool, with the pool-wide bound and the shedding rule."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.max_queue = cfg.max_queue
        self.classes = sorted(
            (ClassQueue(c, cfg.sjf, cfg.aging_s) for c in cfg.classes), key=lambda q: -q.level
        )
        self.by_name = {q.name: q for q in self.classes}
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, e: Entry, class_name: str) -> tuple[Entry, str] | None:
        """Queue `e`; returns an evicted lower-class entry (and its class) when the pool was full, raises
        QueueFull when `e` itself does not fit."""
        q = self.by_name[class_name]
        if len(q) >= q.max_queue:
            raise QueueFull("queue_full")
        evicted: tuple[Entry, str] | None = None
        if self.size >= self.max_queue:
            # Shed the newest request of the lowest class below this one: it has waited least.
            victim_q = next((c for c in reversed(self.classes) if c.level < q.level and len(c)), None)
            if victim_q is None:
                raise QueueFull("queue_full")
            victim = victim_q.newest()
            assert victim is not None
            victim_q.remove(victim)
            self.size -= 1
            evicted = (victim, victim_q.name)
        q.push(e)
        self.size += 1
        return evicted

    def remove(self, e: Entry, class_name: str) -> None:
        if e.live:
            self.by_name[class_name].remove(e)
            self.size -= 1

    def peek(self, now: float) -> tuple[Entry, str] | None:
        """The entry (and its class) `pop(now)` would return."""
        for q in self.classes:
            if len(q):
                e = q.peek(now)
                if e is not None:
                    return e, q.name
        return None

    def pop(self, now: float) -> tuple[Entry, str] | None:
        for q in self.classes:
            if len(q):
                e = q.pop(now)
                if e is not None:
                    self.size -= 1
                    return e, q.name
        return None


class PoolQueueStats(TypedDict):
    """One pool's queue: gauges."""

    queued: dict[str, int]  # per class
    outstanding: int  # tickets granted and not yet released
    outstanding_tokens: int
    oldest_wait_s: float  # how long the longest-waiting queued request has waited


class WaitStats(TypedDict):
    count: int
    sum: float
    max: float


class SchedulerStats(TypedDict):
    """What `Scheduler.stats()` reports; counters unless said otherwise, keyed by class name."""

    queue_depth: dict[str, int]  # gauge, over all pools
    pools: dict[str, PoolQueueStats]  # pools that have seen a request
    admitted: dict[str, int]
    queued_total: dict[str, int]  # admitted ones that had to queue first
    shed: dict[str, dict[str, int]]  # per class, per reason (SHED_REASONS)
    cancelled_in_queue: dict[str, int]  # clients that left while queued
    wait_s: dict[str, WaitStats]  # over admitted requests (0 for the fast path)
    priority_lowered: int
    prompts_trimmed: int


# -- admission ---------------------------------------------------------------------------------------------
class Ticket:
    """Permission to dispatch one request, held as `with ticket:` (or `release()`d, of which only
    the first call takes effect) until the request is done."""

    __slots__ = ("_state", "tokens")

    def __init__(self, state: _PoolState | None, tokens: int = 0) -> None:
        self._state = state
        self.tokens = tokens

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.outstanding -= 1
            state.outstanding_tokens -= self.tokens
            if state.queue.size:
                state.scheduler._pump(state)


_UNLIMITED = Ticket(None)


@dataclass(slots=True, eq=False)
class _PoolState:
    scheduler: Scheduler
    router: PoolRouter
    queue: PoolQueue
    outstanding: int = 0  # tickets granted and not released (admitted but maybe not leased yet)
    outstanding_tokens: int = 0
    recheck: asyncio.Task[None] | None = None
    # Per replica: (engine figures' updated_at, replica in-flight count when first seen), to count
    # what was dispatched since the engine last reported its waiting queue.
    seen: dict[str, tuple[float, int]] = field(default_factory=dict)


@dataclass(slots=True)
class _WaitStats:
    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, s: float) -> None:
        self.count += 1
        self.total_s += s
        self.max_s = max(self.max_s, s)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        tenants: Iterable[TenantConfig] = (),
        clock: Clock = time.monotonic,
        take: Take | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.classes = PriorityClasses(cfg, tenants)
        self.limits = Limits(self.classes.tenants.values(), take, clock)
        self._levels = self.classes.levels
        # Per replica, the in-flight slots a class must leave free for the classes above it.
        self._reserve_above = {
            c.name: sum(o.reserved_per_replica for o in cfg.classes if o.level > c.level) for c in cfg.classes
        }
        self._pools: dict[str, _PoolState] = {}
        self._seq = itertools.count()
        # Counters for metrics (see stats()).
        self.admitted: dict[str, int] = dict.fromkeys(self._levels, 0)
        self.queued_total: dict[str, int] = dict.fromkeys(self._levels, 0)
        self.shed: dict[str, dict[str, int]] = {c: dict.fromkeys(SHED_REASONS, 0) for c in self._levels}
        self.cancelled: dict[str, int] = dict.fromkeys(self._levels, 0)
        self.waits: dict[str, _WaitStats] = {c: _WaitStats() for c in self._levels}
        self._closing: str | None = None  # set at shutdown: nothing queues any more

    def _expected_output(self, features: RequestFeatures) -> int:
        """Output tokens to expect, for each of the request's sequences (n x prompts)."""
        cfg = self.cfg
        each = min(features.max_tokens or cfg.expected_output_tokens, cfg.max_expected_output_tokens)
        return each * features.sequences

    # -- admission ---------------------------------------------------------------------------------------
    async def admit(self, router: PoolRouter, features: RequestFeatures) -> Ticket:
        """Charge the tenant's rate limits (429), then dispatch now or queue; see the module docstring."""
        cls = features.priority_class
        if self.limits.applies(features.tenant):
            try:
                await self.limits.check(
                    features.tenant, features.prompt_tokens + self._expected_output(features)
                )
            except ShedError as exc:
                self._count_shed(cls, exc.shed_reason)
                raise
        if not self.cfg.enabled:
            return _UNLIMITED
        state = self._pools.get(router.name)
        if state is None or state.router is not router:
            state = self._pools[router.name] = _PoolState(self, router, PoolQueue(self.cfg))
        if not state.queue.size and self._has_room(state, features.prompt_tokens, cls):
            self.admitted[cls] += 1
            self.waits[cls].add(0.0)
            return self._grant(state, features.prompt_tokens)
        if self._closing is not None:
            self._count_shed(cls, "shutting_down")
            raise self._closing_error()
        return await self._wait(state, features)

    def _grant(self, state: _PoolState, tokens: int) -> Ticket:
        state.outstanding += 1
        state.outstanding_tokens += tokens
        return Ticket(state, tokens)

    async def _wait(self, state: _PoolState, features: RequestFeatures) -> Ticket:
        cls = features.priority_class
        loop = asyncio.get_running_loop()
        entry = Entry(
            cost=self._cost(state.router, features),
            tenant=features.tenant,
            enqueued=self.clock(),
            seq=next(self._seq),
            tokens=features.prompt_tokens,
            request_id=features.request_id,
            future=loop.create_future(),
        )
        try:
            evicted = state.queue.push(entry, cls)
        except QueueFull as exc:
            self._count_shed(cls, exc.reason)
            raise ShedError(
                429, f"queue for class `{cls}` is full", exc.reason, self.cfg.retry_after_s
            ) from None
        self.queued_total[cls] += 1
        if evicted is not None:
            self._evict(*evicted)
        if state.recheck is None or state.recheck.done():
            state.recheck = asyncio.create_task(self._recheck(state))
        self._pump(state)
        fut = entry.future
        assert fut is not None
        try:
            async with asyncio.timeout(self.cfg.queue_timeout_s):
                return await fut
        except TimeoutError:
            if _granted(fut):  # granted in the same instant the timeout fired: use it
                return fut.result()
            if fut.done() and not fut.cancelled():  # evicted in that instant: say so
                raise fut.exception() from None  # type: ignore[misc]
            state.queue.remove(entry, cls)
            self._count_shed(cls, "queue_timeout")
            raise ShedError(
                503,
                f"no capacity for class `{cls}` within {self.cfg.queue_timeout_s:g} s",
                "queue_timeout",
                self.cfg.retry_after_s,
            ) from None
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler): leave the queue now, or give back a
            # ticket granted in the meantime.
            if _granted(fut):
                fut.result().release()
            else:
                state.queue.remove(entry, cls)
                self.cancelled[cls] += 1
            raise

    def _evict(self, entry: Entry, cls: str) -> None:
        self._count_shed(cls, "evicted")
        fut = entry.future
        if fut is not None and not fut.done():
            fut.set_exception(
                ShedError(
                    429,
                    f"shed from the `{cls}` queue to make room for a higher class",
                    "evicted",
                    self.cfg.retry_after_s,
                )
            )

    def _cost(self, router: PoolRouter, features: RequestFeatures) -> int:
        """Estimated job size: prompt tokens not cached on the best replica, plus expected output."""
        uncached = features.prompt_tokens
        if features.block_hashes:
            matched = router.match.index.match(features.block_hashes, list(router.pool.replicas))
            best = max(matched.values(), default=0)
            uncached -= sum(features.block_tokens[:best])
        return max(0, uncached) + self._expected_output(features)

    def _pump(self, state: _PoolState) -> None:
        """Dispatch queued requests, best first, while the pool has headroom."""
        queue = state.queue
        now = self.clock()
        while (best := queue.peek(now)) is not None:
            entry, cls = best
            # Strict priority and order: when the best entry may not go, no other may either.
            if not self._has_room(state, entry.tokens, cls):
                return
            queue.pop(now)
            fut = entry.future
            if fut is None or fut.done():  # cancelled or evicted already
                continue
            self.admitted[cls] += 1
            self.waits[cls].add(self.clock() - entry.enqueued)
            fut.set_result(self._grant(state, entry.tokens))

    async def _recheck(self, state: _PoolState) -> None:
        while state.queue.size:
            await asyncio.sleep(self.cfg.recheck_interval_s)
            self._pump(state)

    # -- headroom ----------------------------------------------------------------------------------------
    def _has_room(self, state: _PoolState, tokens: int, cls: str) -> bool:
        """The pool can take one more request of class `cls`: the gateway's budget summed over serving
        replicas, less the slots reserved for higher classes, is not used up by granted tickets (which
        count requests not leased yet), and at least one replica has headroom by its own in-flight
        counts and, when fresh, by the engine's figures."""
        replicas = state.router.pool.serving("decode")
        if not replicas:
            return True  # nothing to wait for: dispatch answers 503 at once
        cfg = self.cfg
        reserved = self._reserve_above[cls]
        if state.outstanding >= (cfg.max_inflight_requests_per_replica - reserved) * len(replicas):
            return False
        token_cap = cfg.max_inflight_tokens_per_replica
        if (
            token_cap is not None
            and state.outstanding
            and state.outstanding_tokens + tokens > token_cap * len(replicas)
        ):
            return False
        return any(self._replica_room(state, r) for r in replicas)

    def _replica_room(self, state: _PoolState, r: Replica) -> bool:
        cfg = self.cfg
        if r.inflight_requests >= cfg.max_inflight_requests_per_replica:
            return False
        if cfg.max_inflight_tokens_per_replica is not None and r.inflight_requests:
            if r.inflight_tokens >= cfg.max_inflight_tokens_per_replica:
                return False
        if not r.engine_fresh:
            return True
        load = r.engine
        if load.kv_usage >= cfg.max_kv_usage:
            return False
        backlog = load.waiting
        if backlog:
            # The engine was full when it reported: what we sent since then queues behind that too.
            # (An engine with an empty queue is left alone until its next report says otherwise:
            # counting every dispatch as waiting would cap a large engine's ramp-up at a few requests
            # per scrape.)
            seen = state.seen.get(r.name)
            if seen is None or seen[0] != load.updated_at:
                seen = state.seen[r.name] = (load.updated_at, r.inflight_requests)
            backlog += max(0, r.inflight_requests - seen[1])
        return backlog <= cfg.max_waiting_per_replica

    # -- lifecycle and metrics ------------------------------------------------------------------------
    def _count_shed(self, cls: str, reason: str) -> None:
        self.shed[cls][reason] += 1

    def queue_depth(self) -> dict[str, int]:
        depth = dict.fromkeys(self._levels, 0)
        for state in self._pools.values():
            for q in state.queue.classes:
                depth[q.name] += len(q)
        return depth

    def stats(self) -> SchedulerStats:
        """Gauges and counters for metrics, all keyed by class name (see SchedulerStats)."""
        now = self.clock()
        return {
            "queue_depth": self.queue_depth(),
            "pools": {
                name: {
                    "queued": {q.name: len(q) for q in s.queue.classes},
                    "outstanding": s.outstanding,
                    "outstanding_tokens": s.outstanding_tokens,
                    "oldest_wait_s": max(
                        (now - e.enqueued for q in s.queue.classes if (e := q.oldest()) is not None),
                        default=0.0,
                    ),
                }
                for name, s in self._pools.items()
            },
            "admitted": dict(self.admitted),
            "queued_total": dict(self.queued_total),
            "shed": {c: {**r, "prompt_too_large": self.classes.too_large[c]} for c, r in self.shed.items()},
            "cancelled_in_queue": dict(self.cancelled),
            "wait_s": {
                c: {"count": w.count, "sum": w.total_s, "max": w.max_s} for c, w in self.waits.items()
            },
            "priority_lowered": self.classes.priority_lowered,
            "prompts_trimmed": self.classes.prompts_trimmed,
        }

    def shed_queued(self, message: str) -> int:
        """Answer every queued request, and any that would queue from now on, 503 with Retry-After:
        at shutdown a client told to retry elsewhere is better off than one whose connection drops."""
        self._closing = message
        shed = 0
        now = self.clock()
        for state in self._pools.values():
            while (popped := state.queue.pop(now)) is not None:
                entry, cls = popped
                if entry.future is not None and not entry.future.done():
                    self._count_shed(cls, "shutting_down")
                    entry.future.set_exception(self._closing_error())
                    shed += 1
        return shed

    def _closing_error(self) -> ShedError:
        return ShedError(503, self._closing or "", "shutting_down", self.cfg.retry_after_s)

    async def close(self) -> None:
        tasks = [s.recheck for s in self._pools.values() if s.recheck is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _granted(fut: asyncio.Future[Ticket]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None
