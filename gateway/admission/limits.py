"""Per-tenant rate limits (requests/s, tokens/min) as token buckets, and the error every shed request gets.

A request passes only if every bucket of its tenant can pay for it; it is then charged to all of them at
once, so a request refused by one limit never uses up another. A refusal names the wait after which the
same request would pass (`Retry-After`, whole seconds rounded up).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from gateway.config import TenantConfig
from gateway.errors import GatewayError

Clock = Callable[[], float]


class ShedError(GatewayError):
    """A request the gateway refused on purpose (rate limit, full queue, timeout, prompt too large).

    `shed_reason` is the stable label observers count by (RequestRecord.shed_reason)."""

    def __init__(
        self, status: int, message: str, reason: str, retry_after_s: float | None = None, type_: str = ""
    ) -> None:
        headers = {} if retry_after_s is None else {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
        if not type_:
            type_ = "rate_limit_error" if status == 429 else "service_unavailable"
        super().__init__(status, message, type_, reason, headers=headers)
        self.shed_reason = reason


class TokenBucket:
    """`capacity` units, refilled at `rate` units/s. A charge above the capacity is accepted once the
    bucket is full (and drives it negative), so that no single request is refused forever."""

    __slots__ = ("capacity", "clock", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float, clock: Clock = time.monotonic) -> None:
        self.rate = rate
        self.capacity = capacity
        self.clock = clock
        self.level = capacity
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` can be charged (0 = now)."""
        self._refill()
        need = min(amount, self.capacity) - self.level
        return max(0.0, need / self.rate)

    def charge(self, amount: float) -> None:
        self.level -= amount


@dataclass(frozen=True, slots=True)
class Bucket:
    """One charge to a token bucket: `capacity` units refilled at `rate` units/s (TokenBucket semantics:
    a charge above the capacity passes once the bucket is full, and drives it negative)."""

    key: str
    amount: float
    rate: float
    capacity: float


Take = Callable[[Sequence[Bucket]], Awaitable[list[float]]]


class LocalBuckets:
    """Token buckets in this process (the memory state backend, and Redis' fallback when down)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, charges: Sequence[Bucket]) -> list[float]:
        """Charge every bucket if each can pay, else none; per bucket, the seconds until it could."""
        buckets = []
        for c in charges:
            b = self._buckets.get(c.key)
            if b is None:
                b = self._buckets[c.key] = TokenBucket(c.rate, c.capacity, self._clock)
            b.rate, b.capacity = c.rate, c.capacity  # a config reload may change them
            buckets.append(b)
        waits = [b.wait_s(c.amount) for b, c in zip(buckets, charges, strict=True)]
        if not any(waits):
            for b, c in zip(buckets, charges, strict=True):
                b.charge(c.amount)
        return waits


class Limits:
    """The rate limits of every tenant that has one: requests per second (burst: one second's worth)
    and tokens per minute (burst: one minute's worth).

    Charged through `take`, the state backend's buckets: in this process with the memory backend,
    fleet-wide and atomic with Redis, so N gateways together allow a tenant its limit, not N times it.
    """

    def __init__(
        self, tenants: Iterable[TenantConfig], take: Take | None = None, clock: Clock = time.monotonic
    ) -> None:
        self._limited = {t.name: t for t in tenants if t.requests_per_s or t.tokens_per_min}
        self._take = take or _local(LocalBuckets(clock))

    def applies(self, tenant: str | None) -> bool:
        """Whether `tenant` has a rate limit (checked first, so the rest pay no charge)."""
        return tenant is not None and tenant in self._limited

    async def check(self, tenant: str | None, tokens: int) -> None:
        """Charge one request of `tokens`, or raise a 429 ShedError saying how long to wait."""
        cfg = self._limited.get(tenant) if tenant is not None else None
        if cfg is None:
            return
        charges, reasons = [], []
        if cfg.requests_per_s:
            charges.append(
                Bucket(f"tenant:{cfg.name}:requests", 1, cfg.requests_per_s, max(1.0, cfg.requests_per_s))
            )
            reasons.append(("rate_limit_requests", "tenant request rate limit exceeded"))
        if cfg.tokens_per_min:
            charges.append(
                Bucket(
                    f"tenant:{cfg.name}:tokens", tokens, cfg.tokens_per_min / 60.0, float(cfg.tokens_per_min)
                )
            )
            reasons.append(("rate_limit_tokens", "tenant token rate limit exceeded"))
        waits = await self._take(charges)
        wait, (reason, message) = max(zip(waits, reasons, strict=True), key=lambda w: w[0])
        if wait > 0:
            raise ShedError(429, message, reason, wait)


def _local(buckets: LocalBuckets) -> Take:
    async def take(charges: Sequence[Bucket]) -> list[float]:
        return buckets.take(charges)

    return take
