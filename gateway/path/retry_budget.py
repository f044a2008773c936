"""A retry budget: retries may add at most a fraction of the request rate, so that a
failing fleet is not hit by a storm of retries (Envoy/Finagle style)."""

from __future__ import annotations


class RetryBudget:
    """Each request deposits `ratio` tokens (capped); each retry withdraws one.
    `floor` tokens are always there so that a quiet gateway can still retry."""

    __slots__ = ("_cap", "_tokens", "floor", "ratio")

    def __init__(self, ratio: float, floor: int = 10) -> None:
        self.ratio = ratio
        self.floor = floor
        self._cap = float(floor) + 100.0 * ratio
        self._tokens = float(floor)

    def on_request(self) -> None:
        self._tokens = min(self._cap, self._tokens + self.ratio)

    def try_spend(self) -> bool:
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
