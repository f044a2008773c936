"""Per-tenant rate limits (requests/s, tokens/min) as token buckets, and the error every shed request gets.

A request passes only if every bucket of its tenant can pay for it; it is then charged to all of them at
once, so a request refused by one limit never uses up another. A refusal names the wait after which the
same request would pass (`Retry-After`, whole seconds rounded up).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

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


class TenantLimiter:
    """The buckets of one tenant: requests per second (burst: one second's worth) and tokens per
    minute (burst: one minute's worth)."""

    def __init__(self, cfg: TenantConfig, clock: Clock = time.monotonic) -> None:
        self.requests = (
            TokenBucket(cfg.requests_per_s, max(1.0, cfg.requests_per_s), clock)
            if cfg.requests_per_s
            else None
        )
        self.tokens = (
            TokenBucket(cfg.tokens_per_min / 60.0, float(cfg.tokens_per_min), clock)
            if cfg.tokens_per_min
            else None
        )

    def check(self, tokens: int) -> None:
        """Charge one request of `tokens`, or raise a 429 ShedError saying how long to wait."""
        req_wait = self.requests.wait_s(1) if self.requests else 0.0
        tok_wait = self.tokens.wait_s(tokens) if self.tokens else 0.0
        if req_wait > 0 or tok_wait > 0:
            if req_wait >= tok_wait:
                raise ShedError(429, "tenant request rate limit exceeded", "rate_limit_requests", req_wait)
            raise ShedError(429, "tenant token rate limit exceeded", "rate_limit_tokens", tok_wait)
        if self.requests:
            self.requests.charge(1)
        if self.tokens:
            self.tokens.charge(tokens)


class Limits:
    """Rate limiters of every tenant that has a limit configured."""

    def __init__(self, tenants: Iterable[TenantConfig], clock: Clock = time.monotonic) -> None:
        self._by_tenant = {
            t.name: TenantLimiter(t, clock) for t in tenants if t.requests_per_s or t.tokens_per_min
        }

    def check(self, tenant: str | None, tokens: int) -> None:
        limiter = self._by_tenant.get(tenant) if tenant is not None else None
        if limiter is not None:
            limiter.check(tokens)
