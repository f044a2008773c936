"""Retry budgets: retries may add only a fraction of the traffic, so that a failing fleet is not hit
by a storm of them (Envoy/Finagle style), while a quiet gateway can always retry a little.

Retries before the first byte spend `RetryBudget`: each request deposits `ratio` tokens, each retry
withdraws one; `floor` tokens come back over `refill_s` whatever the traffic (so a burst of failures
spends the budget, and time, not only new traffic, restores it).

A continuation of a broken answer is no retry storm: a replica that dies cuts the streams it held,
and each of them deserves its continuation (each answer continues at most `failover.max_resumes`
times anyway). `ContinuationBudget` lets the continuations made in the last `window_s` number up to
`ratio` times the streams at risk, the one asking, those in flight in the pool now and those
already continued (they were in flight when they broke), and never fewer than `floor`. At the
default ratio, 1, every stream a failure cuts is continued; below it, that share of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RetryBudget:
    __slots__ = ("_at", "_cap", "_clock", "_tokens", "floor", "ratio", "refill_s")

    def __init__(
        self,
        ratio: float,
        floor: int = 10,
        refill_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio = ratio
        self.floor = floor
        self.refill_s = refill_s
        self._cap = float(floor) + 100.0 * ratio
        self._tokens = float(floor)
        self._clock = clock
        self._at = clock()

    def on_request(self) -> None:
        self._tokens = min(self._cap, self._tokens + self.ratio)

    def try_spend(self) -> bool:
        now = self._clock()
        if self.refill_s > 0 and self._tokens < self.floor:
            self._tokens = min(
                float(self.floor), self._tokens + self.floor * (now - self._at) / self.refill_s
            )
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class ContinuationBudget:
    __slots__ = ("_clock", "_made", "floor", "ratio", "window_s")

    def __init__(
        self,
        ratio: float = 1.0,
        floor: int = 10,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio = ratio
        self.floor = floor
        self.window_s = window_s
        self._clock = clock
        self._made: deque[float] = deque()  # when each recent continuation was allowed

    def try_spend(self, in_flight: int) -> bool:
        """A continuation, with `in_flight` other requests in the pool now: allowed while the recent
        ones stay under max(floor, ratio x (1 + in_flight + recent))."""
        now = self._clock()
        made = self._made
        while made and made[0] <= now - self.window_s:
            made.popleft()
        if len(made) >= max(self.floor, self.ratio * (1 + in_flight + len(made))):
            return False
        made.append(now)
        return True
