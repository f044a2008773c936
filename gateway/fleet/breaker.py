"""Per-replica circuit breaker: stop sending to a replica that keeps failing, probe it later.

Which outcomes count is the callers' rule (see `gateway/path/claim.py` and docs/untrusted-peers.md,
"Retries, circuit breaking and engine connections"): only transport failures, never an answer the
engine formed.
"""

from __future__ import annotations

import time
from enum import IntEnum, StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Admission(IntEnum):
    """What `try_acquire` granted; falsy when refused."""

    REFUSED = 0
    ADMITTED = 1  # the circuit was closed
    PROBE = 2  # the one half-open probe: only its verdict (or its release) moves the state


class CircuitBreaker:
    """Closed -> open after `failure_threshold` consecutive failures; after `open_s` one probe
    request is let through (half-open); its success closes the circuit, its failure reopens it,
    and a probe that ends without a verdict frees the slot for the next one.

    While the circuit is not closed only the probe's verdict counts: a request admitted before
    the circuit opened may still be answered late, and must neither close the circuit nor take
    the probe's slot away from it."""

    __slots__ = ("_failures", "_open_until", "_probe_in_flight", "failure_threshold", "open_s", "state")

    def __init__(self, failure_threshold: int, open_s: float) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._open_until = 0.0
        self._probe_in_flight = False

    @property
    def probe_in_flight(self) -> bool:
        return self._probe_in_flight

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def allows(self, now: float | None = None) -> bool:
        """May a request be sent now? Does not claim the half-open probe (see `try_acquire`)."""
        if self.state is BreakerState.CLOSED:
            return True
        now = time.monotonic() if now is None else now
        if self.state is BreakerState.OPEN:
            return now >= self._open_until
        return not self._probe_in_flight

    def try_acquire(self, now: float | None = None) -> Admission:
        """Claim the right to send one request; in half-open only one probe at a time."""
        if self.state is BreakerState.CLOSED:
            return Admission.ADMITTED
        now = time.monotonic() if now is None else now
        if self.state is BreakerState.OPEN:
            if now < self._open_until:
                return Admission.REFUSED
            self.state = BreakerState.HALF_OPEN
        if self._probe_in_flight:
            return Admission.REFUSED
        self._probe_in_flight = True
        return Admission.PROBE

    def record_success(self, admission: Admission) -> None:
        if admission is Admission.PROBE:
            self._probe_in_flight = False
        elif self.state is not BreakerState.CLOSED:
            return
        self._failures = 0
        self.state = BreakerState.CLOSED

    def record_failure(self, admission: Admission, now: float | None = None) -> None:
        if admission is Admission.PROBE:
            self._probe_in_flight = False
        elif self.state is not BreakerState.CLOSED:
            return
        self._failures += 1
        if admission is Admission.PROBE or self._failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self._open_until = (time.monotonic() if now is None else now) + self.open_s

    def probe_now(self, now: float | None = None) -> None:
        """Evidence that the engine is up (a passing health check): an open circuit lets its probe
        through at once instead of waiting out `open_s`. The probe's own verdict still decides, so
        an engine whose health endpoint answers while requests fail costs one probe per check."""
        if self.state is BreakerState.OPEN:
            self._open_until = min(self._open_until, time.monotonic() if now is None else now)

    def release(self, admission: Admission) -> None:
        """An attempt that ended without a verdict (the client left, our own limit) frees its probe."""
        if admission is Admission.PROBE:
            self._probe_in_flight = False
