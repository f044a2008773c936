"""Per-replica circuit breaker: stop sending to a replica that keeps failing, probe it later."""

from __future__ import annotations

import time
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Closed -> open after `failure_threshold` consecutive failures; after `open_s` one probe
    request is let through (half-open); its success closes the circuit, its failure reopens it."""

    __slots__ = ("_failures", "_open_until", "_probe_in_flight", "failure_threshold", "open_s", "state")

    def __init__(self, failure_threshold: int, open_s: float) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._open_until = 0.0
        self._probe_in_flight = False

    def allows(self, now: float | None = None) -> bool:
        """May a request be sent now? Does not claim the half-open probe (see `try_acquire`)."""
        if self.state is BreakerState.CLOSED:
            return True
        now = time.monotonic() if now is None else now
        if self.state is BreakerState.OPEN:
            return now >= self._open_until
        return not self._probe_in_flight

    def try_acquire(self, now: float | None = None) -> bool:
        """Claim the right to send one request; in half-open only one probe at a time."""
        if self.state is BreakerState.CLOSED:
            return True
        now = time.monotonic() if now is None else now
        if self.state is BreakerState.OPEN:
            if now < self._open_until:
                return False
            self.state = BreakerState.HALF_OPEN
            self._probe_in_flight = False
        if self._probe_in_flight:
            return False
        self._probe_in_flight = True
        return True

    def record_success(self) -> None:
        self._failures = 0
        self._probe_in_flight = False
        self.state = BreakerState.CLOSED

    def record_failure(self, now: float | None = None) -> None:
        self._probe_in_flight = False
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self._open_until = (time.monotonic() if now is None else now) + self.open_s

    def release_probe(self) -> None:
        """A probe that ended without a verdict (e.g. the client left) frees the slot."""
        self._probe_in_flight = False
