"""Per-variant request statistics for judging a rollout: counts, errors, TTFT and e2e percentiles.

A variant is one pool behind one client-facing model name (the alias the client asked for).
`VariantStats` is an observer of RequestRecords: it keeps totals since start and, for the
percentiles and rates, the records of the last `window_s` seconds (at most `max_samples` each).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.path.request_record import RequestRecord

PERCENTILES = (50, 95, 99)


@dataclass(slots=True)
class _Sample:
    at: float
    error: bool
    ttft_s: float | None
    e2e_s: float


@dataclass(slots=True)
class _Variant:
    requests: int = 0
    errors: int = 0
    client_errors: int = 0
    window: deque[_Sample] = field(default_factory=deque)


def is_error(rec: RequestRecord) -> bool:
    """The gateway or the engine failed the request (the client's own 4xx mistakes are not the variant's)."""
    return rec.status >= 500 or rec.status == 429 or rec.error_code == "upstream_stream_error"


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * p // 100))
    return sorted_values[int(rank) - 1]


class VariantStats:
    def __init__(
        self, window_s: float = 300.0, max_samples: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.max_samples = max_samples
        self._clock = clock
        self._variants: dict[tuple[str, str], _Variant] = {}

    def __call__(self, rec: RequestRecord) -> None:
        if rec.pool is None or rec.model is None or rec.client_disconnected or not rec.inference:
            return  # never reached a variant, nobody was there to judge the answer, or no inference
        v = self._variants.get((rec.model, rec.pool))
        if v is None:
            v = self._variants[(rec.model, rec.pool)] = _Variant()
        error = is_error(rec)
        v.requests += 1
        v.errors += error
        v.client_errors += 400 <= rec.status < 500 and rec.status != 429
        v.window.append(_Sample(self._clock(), error, rec.ttft_s, rec.duration_s))
        if len(v.window) > self.max_samples:
            v.window.popleft()

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        """{model alias: {pool: figures}}; latencies in milliseconds over the window."""
        horizon = self._clock() - self.window_s
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (model, pool), v in self._variants.items():
            while v.window and v.window[0].at < horizon:
                v.window.popleft()
            ttft = sorted(s.ttft_s * 1000 for s in v.window if s.ttft_s is not None and not s.error)
            e2e = sorted(s.e2e_s * 1000 for s in v.window if not s.error)
            window_errors = sum(s.error for s in v.window)
            out.setdefault(model, {})[pool] = {
                "requests_total": v.requests,
                "errors_total": v.errors,
                "client_errors_total": v.client_errors,
                "window_s": self.window_s,
                "window_requests": len(v.window),
                "window_error_rate": window_errors / len(v.window) if v.window else None,
                "ttft_ms": {f"p{p}": percentile(ttft, p) for p in PERCENTILES},
                "e2e_ms": {f"p{p}": percentile(e2e, p) for p in PERCENTILES},
            }
        return out
