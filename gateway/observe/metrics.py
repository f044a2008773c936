"""Prometheus metrics: per-request series from RequestRecords, fleet gauges read at scrape time.

Request series are fed by an observer of every request's record; it caches the bound label
children per label tuple, so a request costs one dict lookup and a few additions. The children
are plain numbers, not prometheus_client's metrics: those take a lock per increment (ten a
request, 3.7 us of the request's CPU), and every request is observed on the one event loop. A
collector turns them into the same samples prometheus_client's Counter and Histogram expose. Replica
health, load, circuit state, rollout weights and scheduler figures are not tracked per
request at all: a custom collector reads them (through a `GatewayView`) when Prometheus scrapes.
Every label is bounded: statuses are exact codes from a small set or a class, free-form
reasons are capped per pool, and request ids and tenants never become labels.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import metrics as client_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

from gateway.admission.scheduler import SchedulerStats
from gateway.fleet.breaker import BreakerState
from gateway.observe.view import GatewayView
from gateway.path.exchange import Exchange, Reply
from gateway.path.request_record import RequestRecord
from gateway.routing.precise_prefix import EVENTS_STATES

log = logging.getLogger(__name__)

NONE = "none"  # label value when the request never got that far (no pool, no replica)
# Statuses worth telling apart exactly; anything else is counted by class.
EXACT_STATUSES = frozenset({200, 400, 401, 403, 404, 408, 413, 422, 429, 499, 500, 502, 503, 504})
TTFT_HALF_LIFE_S = 30.0  # how fast the pool's recent-TTFT average forgets (an autoscaling signal)
MAX_REASONS_PER_POOL = 32  # route and shed reasons are free-form strings set by plugins

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Label of each IndexerStats counter in kvgate_kv_event_blocks.
_EVENT_OUTCOMES = (
    ("stored", "stored"),
    ("removed", "removed"),
    ("orphan", "orphans"),
    ("block_size_mismatch", "block_size_mismatch"),
    ("foreign_media", "foreign_media"),
    ("malformed", "malformed"),
)
# A replica's event stream: (SubscriberStats attribute, metric name after kvgate_kv_event_, help).
_STREAM_COUNTERS = (
    ("replays", "replays", "Replays of missed batches asked of the engine's replay socket"),
    ("replayed", "batches_replayed", "Batches applied from replays"),
    (
        "resets",
        "resets",
        "Times the replica's index entries were forgotten: missed batches could not be replayed",
    ),
    ("stale", "batches_stale", "Batches at or below the last applied number (late or replayed): ignored"),
    ("restarts", "restarts", "Times the engine's numbers started over (it restarted): its entries forgotten"),
)


def status_label(status: int) -> str:
    if status in EXACT_STATUSES:
        return str(status)
    if status == 0:  # the record never got a status: an unhandled error, answered with 500
        return "500"
    return f"{min(max(status // 100, 1), 5)}xx"


def queued_by_class(stats: SchedulerStats, pool: str) -> dict[str, int]:
    """Requests waiting for admission in a pool, per priority class (none before its first request)."""
    entry = stats["pools"].get(pool)
    return dict(entry["queued"]) if entry is not None else {}


def flatten_numbers(data: Mapping[str, Any], limit: int = 500) -> dict[str, float]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1.0}`; non-numeric leaves are skipped, output is capped."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if len(out) >= limit:
            return
        if isinstance(value, bool | int | float):
            out[prefix] = float(value)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", data)
    return out


class LoopCounter:
    """A counter child updated from the event loop only; read (a float at a time) by the scrape."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        return [("_total", {}, self.value)]


class LoopHistogram:
    """A histogram child as prometheus_client's (an observation counts in the first bucket whose
    bound is at least it), updated from the event loop only."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # ascending, +Inf last
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        out: list[tuple[str, dict[str, str], float]] = []
        acc = 0.0
        for bound, n in zip(self.bounds, list(self.counts), strict=True):
            acc += n
            out.append(("_bucket", {"le": floatToGoString(bound)}, acc))
        out.append(("_count", {}, acc))
        out.append(("_sum", {}, self.sum))
        return out


class LoopFamily:
    """A labelled metric whose children are LoopCounters or LoopHistograms: `labels(...)` as in
    prometheus_client, `metric()` the samples its Counter or Histogram would expose."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float] | None = None
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = None if buckets is None else (*buckets, INF)
        self.children: dict[tuple[str, ...], LoopCounter | LoopHistogram] = {}

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            child = LoopCounter() if self.bounds is None else LoopHistogram(self.bounds)
            self.children[values] = child
        return child

    def metric(self) -> Metric:
        metric = Metric(self.name, self.documentation, "counter" if self.bounds is None else "histogram")
        created = client_metrics._use_created  # PROMETHEUS_DISABLE_CREATED_SERIES, as the library reads it
        for values, child in list(self.children.items()):  # the loop may add one meanwhile
            labels = dict(zip(self.labelnames, values, strict=True))
            for suffix, extra, value in child.samples():
                metric.add_sample(self.name + suffix, {**labels, **extra}, value)
            if created:
                metric.add_sample(self.name + "_created", labels, child.created)
        return metric


class RequestSeries(Collector):
    """The per-request families, in the order they are exposed."""

    def __init__(self, families: Sequence[LoopFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.metric()


@dataclass(slots=True)
class PoolTraffic:
    """Running totals per pool, for the hit-ratio gauge and the status page."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0
    cpu_matched_tokens: int = 0
    recent_ttft_s: float | None = None  # time-decaying average, half-life TTFT_HALF_LIFE_S
    ttft_at: float = 0.0

    def observe_ttft(self, ttft_s: float, now: float) -> None:
        if self.recent_ttft_s is None:
            self.recent_ttft_s = ttft_s
        else:
            # Each sample weighs the time since the previous one: a time average, whatever the rate.
            keep = 0.5 ** (max(0.0, now - self.ttft_at) / TTFT_HALF_LIFE_S)
            self.recent_ttft_s = keep * self.recent_ttft_s + (1 - keep) * ttft_s
        self.ttft_at = max(self.ttft_at, now)

    @property
    def hit_ratio(self) -> float | None:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(slots=True)
class ReplicaTraffic:
    """Running token totals per replica name (kept across its restarts), for the status page."""

    prompt_tokens: int = 0
    matched_tokens: int = 0
    cpu_matched_tokens: int = 0


@dataclass(slots=True)
class _Bound:
    """The label children one kind of request touches, bound once."""

    requests: Any
    duration: Any
    ttft: Any | None
    queue: Any | None
    decision: Any | None
    prompt_tokens: Any  # these three are None exactly when `decision` is
    matched_tokens: Any
    cpu_matched_tokens: Any
    replica_traffic: ReplicaTraffic | None
    retries: Any
    shed: Any | None
    disconnects: Any
    traffic: PoolTraffic | None
    error: bool


class GatewayMetrics:
    """The registry behind `/metrics` and the observer that feeds it."""

    def __init__(self, view: GatewayView) -> None:
        self.view = view
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = LoopFamily(
            "kvgate_requests",
            "Requests answered, by client-facing model, endpoint, pool (rollout variant), replica, status",
            ["model", "endpoint", "pool", "replica", "status"],
        )
        self.duration = LoopFamily(
            "kvgate_request_duration_seconds",
            "Gateway-side end-to-end time, request arrival to last byte (per replica: see TTFT)",
            ["pool", "stream"],
            buckets=DURATION_BUCKETS,
        )
        self.ttft = LoopFamily(
            "kvgate_time_to_first_byte_seconds",
            "Gateway-side time to the first body byte sent to the client (TTFT when streaming)",
            ["pool", "replica", "stream"],
            buckets=TTFT_BUCKETS,
        )
        self.queue = LoopFamily(
            "kvgate_queue_wait_seconds",
            "Time spent waiting for admission in the scheduler",
            ["pool", "priority"],
            buckets=QUEUE_BUCKETS,
        )
        self.pd = LoopFamily(
            "kvgate_pd_requests",
            "Requests of prefill/decode pools by how they ran: handoff, skipped (the decode replica "
            "held enough of the prompt), link_full (pd.max_transfer_tokens in transfer) or decode_only "
            "(no prefill leg could be used, or its KV never came)",
            ["pool", "path"],
        )
        self.decisions = LoopFamily(
            "kvgate_routing_decisions",
            "Routing decisions by pool, policy and the policy's reason (cache hit, spill, cold...)",
            ["pool", "policy", "reason"],
        )
        self.prompt_tokens = LoopFamily(
            "kvgate_prompt_tokens", "Prompt tokens routed (gateway's count)", ["pool", "replica"]
        )
        self.matched_tokens = LoopFamily(
            "kvgate_prefix_matched_tokens",
            "Prompt tokens the chosen replica was believed to hold in its prefix cache, by medium: gpu,"
            " or cpu (its CPU tier, after the GPU's match: loaded instead of recomputed)",
            ["pool", "replica", "medium"],
        )
        self.retries = LoopFamily("kvgate_retries", "Upstream attempts beyond the first", ["pool"])
        self.resumed = LoopFamily(
            "kvgate_resumed",
            "Answers continued on another replica after their attempt broke mid-answer, by why it broke",
            ["pool", "reason"],
        )
        self.resume_blocked = LoopFamily(
            "kvgate_resume_blocked",
            "Answers failover followed that could no longer be continued, by why (too_long: past"
            " failover.max_kept_bytes; too_large: an assembled answer past upstream.max_response_bytes;"
            " tool_call, reasoning, diverged)",
            ["pool", "reason"],
        )
        self.shed = LoopFamily(
            "kvgate_shed_requests", "Requests refused by admission control", ["pool", "priority", "reason"]
        )
        self.disconnects = LoopFamily(
            "kvgate_client_disconnects", "Requests whose client went away before the answer ended", ["pool"]
        )
        reg.register(
            RequestSeries(
                [
                    self.requests,
                    self.duration,
                    self.ttft,
                    self.queue,
                    self.decisions,
                    self.pd,
                    self.prompt_tokens,
                    self.matched_tokens,
                    self.retries,
                    self.resumed,
                    self.resume_blocked,
                    self.shed,
                    self.disconnects,
                ]
            )
        )
        reg.register(FleetCollector(view, self))
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        self.traffic: dict[str, PoolTraffic] = {}
        self.replica_traffic: dict[tuple[str, str], ReplicaTraffic] = {}
        self._bound: dict[tuple[Any, ...], _Bound] = {}
        self._models = frozenset(view.catalog.names())
        self._reasons: dict[str, set[str]] = {}

    # -- the observer ---------------------------------------------------------------------
    def __call__(self, rec: RequestRecord) -> None:
        if not rec.inference:
            model = rec.model if rec.model in self._models else "other"
            pool, replica = rec.pool or NONE, rec.replica or NONE
            self.requests.labels(model, rec.endpoint, pool, replica, status_label(rec.status)).inc()
            return
        key = (
            # A model name is the client's free text: only the names served key the cache (as they
            # label the series), or every made-up name would keep an entry for good.
            rec.model if rec.model in self._models else None,
            rec.endpoint,
            rec.pool,
            rec.replica,
            rec.status,
            rec.stream,
            rec.priority_class,
            rec.route_reason,
            rec.shed_reason,
        )
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self._bind(rec)
        bound.requests.inc()
        bound.duration.observe(rec.duration_s)
        if rec.pd is not None:
            self.pd.labels(rec.pool or NONE, rec.pd).inc()
        if bound.ttft is not None:
            ttft = rec.ttft_s
            if ttft is not None:
                bound.ttft.observe(ttft)
                if bound.traffic is not None:
                    bound.traffic.observe_ttft(ttft, rec.ended or rec.first_byte_at or 0.0)
        if bound.queue is not None:
            bound.queue.observe(rec.queued_s)
        if bound.decision is not None:
            bound.decision.inc()
            bound.prompt_tokens.inc(rec.prompt_tokens)
            bound.matched_tokens.inc(rec.matched_tokens)
            bound.cpu_matched_tokens.inc(rec.cpu_matched_tokens)
            per_replica = bound.replica_traffic
            if per_replica is not None:
                per_replica.prompt_tokens += rec.prompt_tokens
                per_replica.matched_tokens += rec.matched_tokens
                per_replica.cpu_matched_tokens += rec.cpu_matched_tokens
        if rec.retries:
            bound.retries.inc(rec.retries)
        for resumed in rec.resumed:  # rare: not worth a bound child
            self.resumed.labels(rec.pool or NONE, resumed.partition("@")[0]).inc()
        if rec.resume_blocked is not None:  # rare: not worth a bound child
            self.resume_blocked.labels(rec.pool or NONE, rec.resume_blocked).inc()
        if bound.shed is not None:
            bound.shed.inc()
        if rec.client_disconnected:
            bound.disconnects.inc()
        traffic = bound.traffic
        if traffic is not None:
            traffic.requests += 1
            traffic.errors += bound.error
            if bound.decision is not None:
                traffic.prompt_tokens += rec.prompt_tokens
                traffic.matched_tokens += rec.matched_tokens
                traffic.cpu_matched_tokens += rec.cpu_matched_tokens

    def _bounded(self, pool: str, value: str | None, default: str) -> str:
        if not value:
            return default
        seen = self._reasons.setdefault(pool, set())
        if value in seen:
            return value
        if len(seen) >= MAX_REASONS_PER_POOL:
            return "other"
        seen.add(value)
        return value

    def _bind(self, rec: RequestRecord) -> _Bound:
        pool = rec.pool or NONE
        replica = rec.replica or NONE
        stream = "true" if rec.stream else "false"
        model = rec.model if rec.model in self._models else "other"
        status = status_label(rec.status)
        routed = rec.pool is not None and rec.replica is not None
        pool_obj = self.view.pools.get(rec.pool) if rec.pool else None
        policy = pool_obj.cfg.policy.type if pool_obj is not None else NONE
        priority = rec.priority_class or NONE
        traffic = None
        if rec.pool is not None:
            traffic = self.traffic.setdefault(rec.pool, PoolTraffic())
        return _Bound(
            requests=self.requests.labels(model, rec.endpoint, pool, replica, status),
            duration=self.duration.labels(pool, stream),
            ttft=self.ttft.labels(pool, replica, stream) if routed and rec.status < 400 else None,
            queue=self.queue.labels(pool, priority) if rec.priority_class is not None else None,
            decision=(
                self.decisions.labels(pool, policy, self._bounded(pool, rec.route_reason, "unspecified"))
                if routed
                else None
            ),
            prompt_tokens=self.prompt_tokens.labels(pool, replica) if routed else None,
            matched_tokens=self.matched_tokens.labels(pool, replica, "gpu") if routed else None,
            cpu_matched_tokens=self.matched_tokens.labels(pool, replica, "cpu") if routed else None,
            replica_traffic=(
                self.replica_traffic.setdefault((rec.pool, rec.replica), ReplicaTraffic())
                if rec.pool is not None and rec.replica is not None
                else None
            ),
            retries=self.retries.labels(pool),
            shed=(
                self.shed.labels(pool, priority, self._bounded(pool, rec.shed_reason, "unspecified"))
                if rec.shed_reason
                else None
            ),
            disconnects=self.disconnects.labels(pool),
            traffic=traffic,
            error=rec.status >= 500 or rec.status == 0,
        )

    # -- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def handle(self, request: Exchange) -> Reply:
        # Rendering a large fleet takes tens of milliseconds: off the event loop, requests keep flowing.
        body = await asyncio.to_thread(self.render)
        return Reply(200, body, {"Content-Type": CONTENT_TYPE_LATEST})


class FleetCollector(Collector):
    """Gauges read from the gateway's objects at scrape time: nothing is maintained per request.

    It runs in a worker thread while the event loop may add replicas or pools, so it iterates
    over copies of the live collections."""

    def __init__(self, view: GatewayView, metrics: GatewayMetrics) -> None:
        self.view = view
        self.metrics = metrics

    @staticmethod
    def _precise(view: GatewayView) -> Iterator[Metric]:
        """Precise prefix mode: what the engines' KV events did to the index, and what was lost."""
        pools = [(name, r.precise) for name, r in list(view.routers.items()) if r.precise is not None]
        if not pools:
            return
        blocks = CounterMetricFamily(
            "kvgate_kv_event_blocks",
            "Blocks applied from engine KV events (stored, removed) or skipped (orphan: parent unknown, "
            "block_size_mismatch, foreign_media: not GPU, malformed)",
            labels=["pool", "outcome"],
        )
        batches = CounterMetricFamily(
            "kvgate_kv_event_batches", "KV event batches received", labels=["pool", "replica"]
        )
        lost = CounterMetricFamily(
            "kvgate_kv_event_batches_lost",
            "Batches the sequence numbers show were missed",
            labels=["pool", "replica"],
        )
        clears = CounterMetricFamily(
            "kvgate_kv_event_clears",
            "AllBlocksCleared events applied (an engine dropped its whole prefix cache: a reset or restart)",
            labels=["pool"],
        )
        undecodable = CounterMetricFamily(
            "kvgate_kv_event_decode_errors",
            "KV event messages that could not be decoded (wrong framing, topic or msgpack layout): dropped",
            labels=["pool", "replica"],
        )
        stream = {
            attr: CounterMetricFamily(f"kvgate_kv_event_{name}", help_, labels=["pool", "replica"])
            for attr, name, help_ in _STREAM_COUNTERS
        }
        failures = CounterMetricFamily(
            "kvgate_precise_tokenize_failures",
            "Requests no engine tokenized (matched against the approximate index instead)",
            labels=["pool"],
        )
        state = GaugeMetricFamily(
            "kvgate_kv_events_state",
            "1 for the replica's KV event stream state: ok, waiting (none yet, none owed), missing "
            "(owed longer than prefix.kv_events_timeout_s: the replica is routed by the approximate index)",
            labels=["pool", "replica", "state"],
        )
        fallback = CounterMetricFamily(
            "kvgate_precise_fallback_decisions",
            "Precise-mode routing decisions for a replica scored on the approximate index (its KV events "
            "missing, no publisher, or the prompt not tokenized)",
            labels=["pool", "replica"],
        )
        now = time.monotonic()
        for name, precise in pools:
            st = precise.indexer.stats
            for outcome, attr in _EVENT_OUTCOMES:
                blocks.add_metric([name, outcome], getattr(st, attr))
            clears.add_metric([name], st.cleared)
            for replica, sub in list(precise.subscribers.items()):
                batches.add_metric([name, replica], sub.stats.batches)
                lost.add_metric([name, replica], sub.stats.gaps)
                undecodable.add_metric([name, replica], sub.stats.decode_errors)
                for attr, family in stream.items():
                    family.add_metric([name, replica], getattr(sub.stats, attr))
                current = precise.events_state(replica, now)
                for value in EVENTS_STATES:
                    state.add_metric([name, replica, value], float(current == value))
            for replica, n in list(precise.fallback_decisions.items()):
                fallback.add_metric([name, replica], n)
            failures.add_metric([name], precise.tokenize_failures)
        yield from (blocks, clears, batches, lost, undecodable, *stream.values(), failures, state, fallback)

    @staticmethod
    def _connections(view: GatewayView) -> Iterator[Metric]:
        guard = view.connections()
        if guard is None:
            return
        open_ = GaugeMetricFamily(
            "kvgate_client_connections",
            "Client connections: within server.max_connections, or overflow (probes only)",
            labels=["kind"],
        )
        open_.add_metric(["counted"], guard.open)
        open_.add_metric(["overflow"], guard.overflow)
        closed = CounterMetricFamily(
            "kvgate_client_connections_closed",
            "Client connections the gateway closed: header or idle timeout, evicted to make room "
            "at the cap, refused with 503 beyond it, dropped on accept with the reserve full",
            labels=["reason"],
        )
        for reason, n in guard.closed.items():
            closed.add_metric([reason], n)
        yield from (open_, closed)

    def _pool_signals(self, view: GatewayView, stats: SchedulerStats) -> Iterator[Metric]:
        """Per pool, what an autoscaler (HPA, KEDA) scales a pool's engines on."""
        replicas = GaugeMetricFamily(
            "kvgate_pool_replicas",
            "Replicas by state: available (taking requests), draining, unavailable (unhealthy, circuit open)",
            labels=["pool", "state"],
        )
        kv = GaugeMetricFamily(
            "kvgate_pool_kv_usage_ratio",
            "Mean engine KV cache usage over the available replicas with fresh load figures",
            labels=["pool"],
        )
        waiting = GaugeMetricFamily(
            "kvgate_pool_engine_waiting_requests",
            "Requests waiting inside the engines of the available replicas (fresh figures only)",
            labels=["pool"],
        )
        oldest = GaugeMetricFamily(
            "kvgate_pool_queue_oldest_wait_seconds",
            "How long the longest-waiting request in the gateway's queue has waited (0: empty)",
            labels=["pool"],
        )
        ttft = GaugeMetricFamily(
            "kvgate_pool_estimated_ttft_seconds",
            f"Time to first byte a new request can expect: the larger of the recent average (half-life "
            f"{TTFT_HALF_LIFE_S:g} s) and the oldest queued request's wait",
            labels=["pool"],
        )
        pools = stats["pools"]
        for name, pool in list(view.pools.items()):
            counts = {"available": 0, "draining": 0, "unavailable": 0}
            usage: list[float] = []
            queued_in_engines = 0
            for r in list(pool.replicas.values()):
                state = "draining" if r.draining else "available" if r.available else "unavailable"
                counts[state] += 1
                if state == "available" and r.engine_fresh:
                    usage.append(r.engine.kv_usage)
                    queued_in_engines += r.engine.waiting
            for state, n in counts.items():
                replicas.add_metric([name, state], n)
            if usage:
                kv.add_metric([name], sum(usage) / len(usage))
            waiting.add_metric([name], queued_in_engines)
            entry = pools.get(name)
            wait = entry["oldest_wait_s"] if entry is not None else 0.0
            oldest.add_metric([name], wait)
            traffic = self.metrics.traffic.get(name)
            recent = traffic.recent_ttft_s if traffic is not None else None
            if recent is not None or wait:
                ttft.add_metric([name], max(recent or 0.0, wait))
        yield from (replicas, kv, waiting, oldest, ttft)

    def collect(self) -> Iterator[Metric]:
        view = self.view
        labels = ["pool", "replica", "role", "kind"]
        healthy = GaugeMetricFamily("kvgate_replica_healthy", "1 if the health check passes", labels=labels)
        available = GaugeMetricFamily(
            "kvgate_replica_available",
            "1 if eligible for new requests (healthy, not draining, circuit allows)",
            labels=labels,
        )
        draining = GaugeMetricFamily("kvgate_replica_draining", "1 while draining", labels=labels)
        circuit = GaugeMetricFamily(
            "kvgate_replica_circuit_state",
            "1 for the circuit breaker's current state",
            labels=[*labels, "state"],
        )
        inflight = GaugeMetricFamily(
            "kvgate_replica_inflight_requests",
            "Requests the gateway has in flight on the replica",
            labels=labels,
        )
        inflight_tokens = GaugeMetricFamily(
            "kvgate_replica_inflight_tokens", "Prompt tokens of the requests in flight", labels=labels
        )
        routed = CounterMetricFamily(
            "kvgate_replica_requests", "Upstream attempts sent to the replica", labels=labels
        )
        waiting = GaugeMetricFamily(
            "kvgate_replica_engine_waiting_requests", "Engine-reported waiting requests", labels=labels
        )
        running = GaugeMetricFamily(
            "kvgate_replica_engine_running_requests", "Engine-reported running requests", labels=labels
        )
        kv = GaugeMetricFamily(
            "kvgate_replica_engine_kv_usage_ratio", "Engine KV cache usage 0..1", labels=labels
        )
        fresh = GaugeMetricFamily(
            "kvgate_replica_engine_load_fresh", "1 if the engine load figures are recent", labels=labels
        )
        # The engine's own counters, as last scraped (they restart at 0 with the engine): what the
        # gateway's kvgate_prefix_matched_tokens_total is checked against, medium by medium.
        hits = GaugeMetricFamily(
            "kvgate_replica_engine_cached_tokens",
            "Engine-reported prompt tokens found in its prefix cache (gpu: vllm:prefix_cache_hits) or "
            "loaded from its CPU tier (cpu: vllm:external_prefix_cache_hits), since it started",
            labels=[*labels, "medium"],
        )
        loads = GaugeMetricFamily(
            "kvgate_replica_engine_cpu_loads",
            "Engine-reported CPU-tier load jobs since it started (vllm:kv_offload_load_size_count)",
            labels=labels,
        )
        for pool in list(view.pools.values()):
            for r in list(pool.replicas.values()):
                lv = [pool.name, r.name, r.role, r.kind]
                healthy.add_metric(lv, float(r.healthy))
                available.add_metric(lv, float(r.available))
                draining.add_metric(lv, float(r.draining))
                for state in BreakerState:
                    circuit.add_metric([*lv, state.value], float(r.circuit is state))
                inflight.add_metric(lv, r.inflight_requests)
                inflight_tokens.add_metric(lv, r.inflight_tokens)
                routed.add_metric(lv, view.routed.of(r))
                waiting.add_metric(lv, r.engine.waiting)
                running.add_metric(lv, r.engine.running)
                kv.add_metric(lv, r.engine.kv_usage)
                fresh.add_metric(lv, float(r.engine_fresh))
                eng = r.engine
                for medium, value in (("gpu", eng.gpu_hit_tokens_total), ("cpu", eng.cpu_hit_tokens_total)):
                    if value is not None:
                        hits.add_metric([*lv, medium], value)
                if eng.cpu_loads_total is not None:
                    loads.add_metric(lv, eng.cpu_loads_total)
        yield from (healthy, available, draining, circuit, inflight, inflight_tokens, routed)
        yield from (waiting, running, kv, fresh, hits, loads)
        stats = view.scheduler_stats()
        yield from self._pool_signals(view, stats)

        hit = GaugeMetricFamily(
            "kvgate_estimated_cache_hit_ratio",
            "Prefix-matched over routed prompt tokens since start (gateway's estimate)",
            labels=["pool"],
        )
        for name, traffic in list(self.metrics.traffic.items()):
            ratio = traffic.hit_ratio
            if ratio is not None:
                hit.add_metric([name], ratio)
        yield hit

        # The bounded caches that hold most of the gateway's memory, so a growing RSS can be told
        # apart from a leak: they fill up to their bounds, then stay.
        index = GaugeMetricFamily(
            "kvgate_prefix_index_entries", "Blocks in the prefix index, over all replicas", labels=["pool"]
        )
        tokens = GaugeMetricFamily(
            "kvgate_token_count_cache_entries", "Prompt blocks whose token count is cached", labels=["pool"]
        )
        for name, router in list(view.routers.items()):
            index.add_metric([name], router.match.index.entries())
            tokens.add_metric([name], router.hasher.cached_blocks())
        yield from (index, tokens)

        weights = GaugeMetricFamily(
            "kvgate_rollout_weight",
            "Configured weight of a pool in a route's rule (the rollout split)",
            labels=["model", "rule", "pool"],
        )
        for model, rules in list(view.routes.routes.items()):
            for i, rule in enumerate(list(rules)):
                for pool_name, weight in zip(rule.pools, rule.weights, strict=True):
                    weights.add_metric([model, str(i), pool_name], weight)
        yield weights

        yield from self._precise(view)
        yield from self._connections(view)
        yield GaugeMetricFamily("kvgate_draining", "1 while the gateway drains", value=float(view.draining()))
        depth = GaugeMetricFamily(
            "kvgate_scheduler_queue_depth",
            "Requests waiting for admission",
            labels=["pool", "priority"],
        )
        for name in list(view.pools):
            for cls, n in queued_by_class(stats, name).items():
                depth.add_metric([name, cls], n)
        yield depth
        sched = GaugeMetricFamily(
            "kvgate_scheduler_stat",
            "Other figures from the scheduler's stats(), flattened to dotted keys",
            labels=["key"],
        )
        for key, value in flatten_numbers({k: v for k, v in stats.items() if k != "pools"}).items():
            sched.add_metric([key], value)
        yield sched
