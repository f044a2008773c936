"""Circuit breaker, claims and the retry budget: the state machine on its own, then end to end
through a real gateway (half-open probes abandoned by clients, probes that time out, a retry
budget running dry), for every transport."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from gateway.fleet.breaker import Admission, BreakerState, CircuitBreaker
from gateway.fleet.replica import Replica
from gateway.path.claim import Claim
from gateway.path.retry_budget import ContinuationBudget, RetryBudget
from tests.conftest import wait_until
from tests.hostile_upstream import TRANSPORTS, HostileUpstream, ask, hostile_settings, marker, openai_error


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def opened(threshold: int = 2, now: float = 0.0) -> CircuitBreaker:
    b = CircuitBreaker(threshold, open_s=10)
    for _ in range(threshold):
        b.record_failure(b.try_acquire(now), now)
    return b


def test_consecutive_failures_open_and_a_success_resets_the_count():
    b = CircuitBreaker(3, open_s=10)
    for outcome in ("fail", "fail", "ok", "fail", "fail"):
        a = b.try_acquire(0)
        assert a is Admission.ADMITTED
        b.record_failure(a, 0) if outcome == "fail" else b.record_success(a)
    assert b.state is BreakerState.CLOSED and b.consecutive_failures == 2
    b.record_failure(b.try_acquire(0), 0)
    assert b.state is BreakerState.OPEN and not b.allows(5) and b.try_acquire(5) is Admission.REFUSED


def test_half_open_admits_one_probe_and_its_verdict_decides():
    b = opened()
    assert b.allows(10) and b.try_acquire(10) is Admission.PROBE
    assert b.state is BreakerState.HALF_OPEN and b.probe_in_flight
    assert not b.allows(10) and b.try_acquire(10) is Admission.REFUSED
    b.record_success(Admission.PROBE)
    assert b.state is BreakerState.CLOSED and not b.probe_in_flight and b.allows(10)

    b = opened()
    b.record_failure(b.try_acquire(10), 10)
    assert b.state is BreakerState.OPEN and not b.probe_in_flight
    assert not b.allows(19) and b.try_acquire(20) is Admission.PROBE  # open_s counted from the failure


def test_evidence_of_life_lets_an_open_circuit_probe_at_once():
    b = opened(now=0.0)
    assert not b.allows(1.0)
    b.probe_now(1.0)
    assert b.allows(1.0) and b.try_acquire(1.0) is Admission.PROBE  # not after open_s (10 s)
    b.probe_now(1.0)  # half-open: nothing changes, the probe in flight decides
    assert b.state is BreakerState.HALF_OPEN and b.try_acquire(1.0) is Admission.REFUSED
    b.record_failure(Admission.PROBE, 1.0)
    assert not b.allows(2.0)


def test_a_probe_without_verdict_frees_the_slot_for_the_next():
    b = opened()
    probe = b.try_acquire(10)
    b.release(probe)
    assert b.state is BreakerState.HALF_OPEN and not b.probe_in_flight
    assert b.try_acquire(10) is Admission.PROBE


def test_late_answers_of_requests_admitted_before_the_circuit_opened_do_not_steal_the_probe():
    b = CircuitBreaker(2, open_s=10)
    early = b.try_acquire(0)  # in flight while the circuit opens
    b.record_failure(b.try_acquire(0), 0)
    b.record_failure(b.try_acquire(0), 0)
    probe = b.try_acquire(10)
    b.record_success(early)
    b.record_failure(early, 10)
    b.release(early)
    assert b.state is BreakerState.HALF_OPEN and b.probe_in_flight  # only the probe decides
    b.record_success(probe)
    assert b.state is BreakerState.CLOSED


def replica() -> Replica:
    return Replica("r0", "http://127.0.0.1:1", "p", breaker=opened())


async def test_a_claim_settles_on_every_way_out():
    r = replica()
    r.breaker = CircuitBreaker(2, open_s=0.001)
    r.breaker.record_failure(Admission.ADMITTED)
    r.breaker.record_failure(Admission.ADMITTED)
    await wait_until(r.breaker.allows, what="half-open")

    async def attempt(entered: asyncio.Event) -> None:
        claim = Claim.take(r, 100)
        assert claim is not None
        with claim:
            entered.set()
            await asyncio.Event().wait()

    entered = asyncio.Event()
    task = asyncio.create_task(attempt(entered))
    await entered.wait()
    assert r.breaker.probe_in_flight and (r.inflight_requests, r.inflight_tokens) == (1, 100)
    assert Claim.take(r, 1) is None  # one probe at a time
    task.cancel()  # the client went away
    await asyncio.gather(task, return_exceptions=True)
    assert not r.breaker.probe_in_flight and (r.inflight_requests, r.inflight_tokens) == (0, 0)

    with pytest.raises(RuntimeError), Claim.take(r, 5) as claim:  # type: ignore[union-attr]
        raise RuntimeError("anything else")
    assert not r.breaker.probe_in_flight and r.inflight_requests == 0

    claim = Claim.take(r, 5)
    assert claim is not None
    claim.answered()
    claim.failed()  # a stream cut short after its head: a closed-circuit failure, not a second verdict
    claim.close()
    claim.close()
    assert r.breaker.state is BreakerState.CLOSED and r.breaker.consecutive_failures == 1
    assert r.inflight_requests == 0 and r.total_requests == 3


def test_retry_budget_floor_ratio_and_cap():
    budget = RetryBudget(0.5, floor=2, refill_s=0)
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    for _ in range(4):
        budget.on_request()
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    for _ in range(10_000):
        budget.on_request()
    assert sum(budget.try_spend() for _ in range(1000)) == 2 + 50  # floor + 100 x ratio


def test_the_retry_budgets_floor_comes_back_with_time():
    """Issue 35: spent by a burst, the budget came back only with new requests."""
    now = [0.0]
    budget = RetryBudget(0.0, floor=4, refill_s=10.0, clock=lambda: now[0])
    assert [budget.try_spend() for _ in range(5)] == [True] * 4 + [False]
    now[0] += 5.0  # half the refill time: half the floor
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    now[0] += 100.0  # never more than the floor
    assert sum(budget.try_spend() for _ in range(10)) == 4


def test_continuations_scale_with_the_streams_in_flight_and_come_back_with_time():
    now = [0.0]
    every = ContinuationBudget(ratio=1.0, floor=10, window_s=10.0, clock=lambda: now[0])
    # A replica dies under 200 streams: as each is cut and continued, fewer are in flight.
    assert all(every.try_spend(in_flight=200 - i) for i in range(200))
    assert all(every.try_spend(in_flight=0) for _ in range(50))  # answers breaking one after another
    half = ContinuationBudget(ratio=0.5, floor=10, window_s=10.0, clock=lambda: now[0])
    assert sum(half.try_spend(in_flight=199 - i) for i in range(200)) == 100
    assert not half.try_spend(in_flight=0)  # spent: past it, none
    now[0] += 10.0
    assert sum(half.try_spend(in_flight=0) for _ in range(50)) == 10  # the floor, once the window passed


async def test_abandoned_half_open_probes_do_not_keep_a_pool_down(transport: str, gateway):
    """The issue's reproduction: threshold 2, a short open_s, an engine that refuses connections
    and then comes back (slow), requests abandoned by their clients while the probe is in flight."""
    srv = HostileUpstream("stall-head")
    await srv.start()
    await srv.stop()  # the port now refuses
    settings = hostile_settings(
        [srv.url],
        transport,
        breaker={"failure_threshold": 2, "open_s": 0.3},
        upstream={"first_byte_timeout_s": 30},
    )
    gw = await gateway(settings)
    r0 = gw.runtime.pools["p"].replicas["r0"]
    try:
        async with httpx.AsyncClient() as c:
            assert openai_error(await ask(c, gw, marker()))["code"] == "upstream_unreachable"
            assert r0.breaker.state is BreakerState.OPEN
            await srv.start()  # back on the same port, slow to answer
            for _ in range(3):
                await wait_until(r0.breaker.allows, what="the circuit to let a probe through")
                body = {"model": "m", "prompt": marker()}
                tries = [c.post(gw.url + "/v1/completions", json=body, timeout=0.5) for _ in range(4)]
                results = await asyncio.gather(*tries, return_exceptions=True)
                assert sum(isinstance(x, httpx.ReadTimeout) for x in results) == 1  # the probe, abandoned
                assert all(x.status_code == 503 for x in results if isinstance(x, httpx.Response))
                await wait_until(lambda: not r0.breaker.probe_in_flight, what="the abandoned probe released")
            srv.mode = "ok"
            await wait_until(r0.breaker.allows, what="the next probe")
            mark = marker()
            r = await ask(c, gw, mark)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == mark
            assert r0.breaker.state is BreakerState.CLOSED and r0.inflight_requests == 0
    finally:
        await srv.stop()


async def test_a_probe_that_times_out_reopens_the_circuit(transport: str, gateway):
    srv = await HostileUpstream("close").start()
    settings = hostile_settings(
        [srv.url],
        transport,
        breaker={"failure_threshold": 2, "open_s": 0.2},
        upstream={"first_byte_timeout_s": 0.3},
    )
    gw = await gateway(settings)
    r0 = gw.runtime.pools["p"].replicas["r0"]
    try:
        async with httpx.AsyncClient() as c:
            await ask(c, gw, marker())
            assert r0.breaker.state is BreakerState.OPEN
            srv.mode = "stall-head"
            await wait_until(r0.breaker.allows, what="the probe")
            assert openai_error(await ask(c, gw, marker()))["code"] == "upstream_timeout"
            assert r0.breaker.state is BreakerState.OPEN and not r0.breaker.probe_in_flight
    finally:
        await srv.stop()


async def test_retry_budget_stops_retries_when_spent(transport: str, gateway):
    a, b = await HostileUpstream("close").start(), await HostileUpstream("close").start()
    retry = {"budget_ratio": 0, "budget_refill_s": 0}  # the floor does not come back during the test
    gw = await gateway(hostile_settings([a.url, b.url], transport, retry=retry))
    try:
        async with httpx.AsyncClient() as c:
            for _ in range(7):
                assert openai_error(await ask(c, gw, marker()))["code"] == "upstream_disconnected"
        deliveries = Counter(a.markers() + b.markers())
        # The floor (10 retries) pays for five requests' two retries each; then none is left.
        assert sorted(deliveries.values(), reverse=True) == [3] * 5 + [1] * 2
    finally:
        await a.stop()
        await b.stop()


async def test_a_passing_health_check_ends_an_open_circuit_early(transport: str, gateway):
    """An engine back from a crash gets traffic once its health check passes, not after open_s."""
    srv = await HostileUpstream("ok").start()
    await srv.stop()  # the port now refuses
    settings = hostile_settings([srv.url], transport, breaker={"failure_threshold": 1, "open_s": 600})
    settings.health.enabled = True
    settings.health.interval_s = 0.05
    settings.health.failure_threshold = 1_000_000  # the replica stays in the pool: only the circuit decides
    gw = await gateway(settings)
    r0 = gw.runtime.pools["p"].replicas["r0"]
    try:
        async with httpx.AsyncClient() as c:
            assert openai_error(await ask(c, gw, marker()))["code"] == "upstream_unreachable"
            assert r0.breaker.state is BreakerState.OPEN and not r0.breaker.allows()
            await srv.start()  # the same port
            await wait_until(r0.breaker.allows, what="a passing health check to let the probe through")
            mark = marker()
            r = await ask(c, gw, mark)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == mark
            assert r0.breaker.state is BreakerState.CLOSED
    finally:
        await srv.stop()
