"""Summary statistics of one run: percentiles, throughput, load, cache hits, load spread.

Percentiles interpolate linearly between closest ranks (numpy's default), so p50 of [1, 2, 3, 4]
is 2.5. Throughput counts successful measured requests over the measured window: from the first
measured send to the last measured completion. Latencies are reported in milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from bench.client import RequestRecord
from bench.loadgen import RunResult

PERCENTILES = (50, 95, 99)
# The client counts as lagging when it sent this much later than scheduled (p99), or sent at
# under this fraction of the offered rate: then the run measured the client, not the server.
CLIENT_LAG_S = 0.05
CLIENT_RATE_FRACTION = 0.9
SHED_STATUSES = (429, 503)


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution_ms(values: Iterable[float]) -> dict[str, float | None]:
    vals = [v * 1000.0 for v in values]
    out: dict[str, float | None] = {f"p{q}": percentile(vals, q) for q in PERCENTILES}
    out["mean"] = sum(vals) / len(vals) if vals else None
    return out


def cache_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """Fleet hit rate: sum of cached over sum of prompt tokens, over requests that reported both."""
    prompt = cached = 0
    for r in records:
        if r.ok and r.prompt_tokens:
            prompt += r.prompt_tokens
            cached += r.cached_tokens or 0
    return cached / prompt if prompt else None


def load_spread(records: Iterable[RequestRecord]) -> tuple[float | None, dict[str, int]]:
    """max/mean requests per replica (1.0 = perfectly even), and the counts themselves."""
    counts = Counter(r.replica for r in records if r.ok and r.replica)
    if not counts:
        return None, {}
    mean = sum(counts.values()) / len(counts)
    return max(counts.values()) / mean, dict(sorted(counts.items()))


def error_key(r: RequestRecord) -> str:
    if r.status == 200:
        return "stream-error"
    return {0: "connect-error", -1: "timeout"}.get(r.status, str(r.status))


def latency_block(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    return {
        "requests": len(records),
        "ok": len(ok),
        "ttft_ms": distribution_ms(r.ttft for r in ok if r.ttft is not None),
        "itl_ms": distribution_ms(x for r in ok for x in r.itls),
        "e2e_ms": distribution_ms(r.e2e for r in ok if r.e2e is not None),
        "cache_hit_rate": cache_hit_rate(ok),
        "errors": dict(Counter(error_key(r) for r in records if not r.ok)),
    }


def summarize(result: RunResult) -> dict[str, Any]:
    measured = [r for r in result.records if not r.warmup]
    ok = [r for r in measured if r.ok]
    summary = latency_block(measured)
    sent = [(r.sent, r.e2e or 0.0) for r in measured if r.sent is not None]
    start = min((t for t, _ in sent), default=0.0)
    end = max((t + e2e for t, e2e in sent), default=0.0)
    window = end - start
    summary["window_s"] = window
    summary["warmup_requests"] = len(result.records) - len(measured)
    summary["unsent_requests"] = result.unsent
    summary["throughput_rps"] = len(ok) / window if window > 0 else None
    summary["output_tokens_per_s"] = sum(r.output_tokens for r in ok) / window if window > 0 else None
    summary["prompt_tokens"] = sum(r.prompt_tokens or 0 for r in ok)
    summary["cached_tokens"] = sum(r.cached_tokens or 0 for r in ok)
    summary["output_tokens"] = sum(r.output_tokens for r in ok)
    spread, per_replica = load_spread(ok)
    summary["replica_spread"] = spread
    summary["requests_per_replica"] = per_replica
    pools = Counter(r.pool for r in ok if r.pool)
    if pools:
        summary["requests_per_pool"] = dict(sorted(pools.items()))
    summary.update(_load_figures(result))
    shed = [r for r in measured if r.status in SHED_STATUSES]
    if shed:
        # A shed request must tell the client when to come back.
        summary["shed"] = {"count": len(shed), "with_retry_after": sum(1 for r in shed if r.retry_after)}
    if len({r.priority for r in measured}) > 1:
        summary["by_priority"] = _breakdown(measured, "priority")
    # Kinds often are the priority classes themselves (mixed-priority): then once is enough.
    if len({r.kind for r in measured}) > 1 and any(r.kind != str(r.priority) for r in measured):
        summary["by_kind"] = _breakdown(measured, "kind")
    return summary


def _breakdown(records: list[RequestRecord], attr: str) -> dict[str, dict[str, Any]]:
    labels = sorted({str(getattr(r, attr)) for r in records})
    return {label: latency_block([r for r in records if str(getattr(r, attr)) == label]) for label in labels}


def _rate(times: list[float]) -> float | None:
    times = sorted(times)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def _load_figures(result: RunResult) -> dict[str, Any]:
    """Offered vs achieved load, and whether the client failed to keep its own schedule.

    The client is to blame only for the gap between when a request could go (its scheduled time,
    or later when it waited for its session's previous turn) and when it went.
    """
    sent = [(r, r.sent) for r in result.records if r.sent is not None]
    sent_rate = _rate([t for _, t in sent])
    ready_rate = _rate([r.ready for r, _ in sent])
    lag_p99 = percentile([max(0.0, t - r.ready) for r, t in sent], 99)
    warnings: list[str] = list(result.notes)
    if result.load.mode != "closed":
        if lag_p99 is not None and lag_p99 > CLIENT_LAG_S:
            warnings.append(
                f"CLIENT LAGGED ITS SCHEDULE: p99 send delay {lag_p99 * 1000:.0f} ms "
                f"(> {CLIENT_LAG_S * 1000:.0f} ms); the server saw less load than offered"
            )
        if sent_rate is not None and ready_rate is not None and sent_rate < CLIENT_RATE_FRACTION * ready_rate:
            warnings.append(
                f"CLIENT SENT BELOW ITS SCHEDULE: {sent_rate:.2f} req/s sent vs {ready_rate:.2f} req/s due"
            )
        scheduled_rate = _rate([r.scheduled for r, _ in sent])
        if ready_rate and scheduled_rate and ready_rate < CLIENT_RATE_FRACTION * scheduled_rate:
            warnings.append(
                f"session turns waited for earlier turns: {ready_rate:.2f} req/s could be sent "
                f"of {scheduled_rate:.2f} req/s scheduled"
            )
    return {
        "offered_rps": result.offered_rate,
        "sent_rps": sent_rate,
        "client_lag_p99_ms": lag_p99 * 1000 if lag_p99 is not None else None,
        "client_limited": any(w.startswith("CLIENT") for w in warnings),
        "warnings": warnings,
    }
