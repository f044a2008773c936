"""Tenant rate limits on a virtual clock: bursts, refill, Retry-After, all-or-nothing charging."""

from __future__ import annotations

import pytest

from gateway.admission.limits import Limits, ShedError, TokenBucket
from gateway.config import TenantConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_refills_at_its_rate_up_to_capacity() -> None:
    clock = Clock()
    b = TokenBucket(rate=2.0, capacity=4.0, clock=clock)
    b.charge(4)
    assert b.wait_s(1) == pytest.approx(0.5)
    clock.now += 10
    assert b.wait_s(4) == 0.0 and b.level == 4.0  # capped at the capacity
    # A request larger than the bucket passes once the bucket is full, never waits forever.
    assert b.wait_s(100) == 0.0


async def test_requests_per_second_with_retry_after() -> None:
    clock = Clock()
    limits = Limits([TenantConfig(name="t", api_key="k", requests_per_s=2)], clock=clock)
    await limits.check("t", 1)
    await limits.check("t", 1)
    with pytest.raises(ShedError) as exc:
        await limits.check("t", 1)
    assert exc.value.status == 429 and exc.value.shed_reason == "rate_limit_requests"
    assert exc.value.headers == {"Retry-After": "1"}
    clock.now += 0.5
    await limits.check("t", 1)
    await limits.check(None, 1)  # anonymous and unlimited tenants pass
    await limits.check("other", 1)


async def test_tokens_per_minute_and_no_charge_on_refusal() -> None:
    clock = Clock()
    limits = Limits([TenantConfig(name="t", api_key="k", requests_per_s=1, tokens_per_min=600)], clock=clock)
    await limits.check("t", 500)
    clock.now += 1.0  # +1 request, +10 tokens
    with pytest.raises(ShedError) as exc:
        await limits.check("t", 500)
    assert exc.value.shed_reason == "rate_limit_tokens"
    assert exc.value.headers["Retry-After"] == str(39)  # (500 - 110) tokens at 10/s, rounded up
    # The refused request took nothing: the request bucket still has its token, so this passes.
    await limits.check("t", 100)
