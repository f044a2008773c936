"""The gateway against a hostile engine: the issue's reproductions (deliveries with idle
connections, client-caused 500s, stale keep-alive connections), what still opens a circuit,
and a concurrent canary run proving that no answer ever reaches the wrong client. For every
transport; the per-misbehaviour cases are in test_upstream_hostile_cases.py.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from gateway.fleet.breaker import BreakerState
from tests.conftest import SERVER_IMPLS, STARTUP_S, wait_until
from tests.hostile_upstream import (
    MAX_ATTEMPTS,
    TRANSPORTS,
    HostileUpstream,
    answer_marker,
    ask,
    assert_settled,
    hostile_settings,
    marker,
    openai_error,
)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=SERVER_IMPLS)
def server_impl(request: pytest.FixtureRequest) -> str:
    """Every case on both HTTP servers."""
    return request.param


@pytest.fixture
async def hostile():
    servers: list[HostileUpstream] = []

    async def make(mode: str = "ok", echo: bool = True) -> HostileUpstream:
        srv = await HostileUpstream(mode, echo=echo).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        await srv.stop()


async def test_gzip_relayed_with_its_content_encoding(transport: str, hostile, gateway):
    srv = await hostile("gzip")
    gw = await gateway(hostile_settings([srv.url], transport))
    mark = marker()
    async with httpx.AsyncClient() as c:
        r = await ask(c, gw, mark)
    assert r.headers["content-encoding"] == "gzip" and r.json()["choices"][0]["text"] == mark
    srv.mode = "gzip-error"
    async with httpx.AsyncClient() as c:
        r = await ask(c, gw, mark)
    # Rewritten into the OpenAI form after decoding: no Content-Encoding any more.
    assert "content-encoding" not in r.headers
    assert openai_error(r)["message"] == f"bad request {mark}"


async def test_stale_keep_alive_connection_costs_one_resend_and_no_mark(transport: str, hostile, gateway):
    srv = await hostile("stale-on-reuse")
    gw = await gateway(hostile_settings([srv.url], transport))
    replica = gw.runtime.pools["p"].replicas["r0"]
    records: list = []
    gw.runtime.observers.append(records.append)
    async with httpx.AsyncClient() as c:
        first, second = marker(), marker()
        assert (await ask(c, gw, first)).status_code == 200  # leaves one idle keep-alive connection
        r = await ask(c, gw, second)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == second
    assert srv.markers() == [first, second, second]  # once on the stale connection, once on a fresh one
    assert srv.connections_used() == 2
    # Silent: not a retry, not a mark against the replica.
    assert replica.breaker.consecutive_failures == 0 and [r.retries for r in records] == [0, 0]


async def test_engine_that_never_answers_gets_max_attempts_deliveries_despite_idle_connections(
    transport: str, hostile, gateway
):
    """The issue's reproduction: 30 idle pooled connections used to cost 33 deliveries."""
    srv = await hostile("hold")
    # Held answers wait for all 30 to arrive, which can take a while on a loaded machine.
    gw = await gateway(hostile_settings([srv.url], transport, upstream={"first_byte_timeout_s": 30}))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=30) as c:
        pending = [asyncio.create_task(ask(c, gw, marker())) for _ in range(30)]
        await wait_until(lambda: srv.held == 30, what="30 requests held on 30 connections")
        srv.release.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(*pending))
        assert srv.connections_used() == 30
        srv.mode = "close"
        mark = marker()
        r = await ask(c, gw, mark)
    assert openai_error(r)["code"] == "upstream_disconnected"
    assert srv.markers().count(mark) == MAX_ATTEMPTS
    await assert_settled(gw)


async def test_client_caused_500s_do_not_open_any_circuit(transport: str, hostile, gateway):
    """The issue's reproduction: 20 requests that make the engine answer 500 opened all four circuits."""
    servers = [await hostile("poison-500") for _ in range(4)]
    gw = await gateway(
        hostile_settings([s.url for s in servers], transport, breaker={"failure_threshold": 5})
    )
    async with httpx.AsyncClient() as c:
        for _ in range(20):
            r = await ask(c, gw, "boom-" + marker())
            assert r.status_code == 500 and openai_error(r)["message"] == "generation crashed"
        replicas = gw.runtime.pools["p"].replicas.values()
        assert [r.breaker.state for r in replicas] == [BreakerState.CLOSED] * 4
        assert all(r.available for r in replicas)
        mark = marker()
        r = await ask(c, gw, mark)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == mark
    assert sum(len(s.deliveries) for s in servers) == 21  # a 500 is relayed, not retried


async def test_transport_failures_still_open_the_circuit(transport: str, hostile, gateway):
    srv = await hostile("close")
    gw = await gateway(hostile_settings([srv.url], transport, breaker={"failure_threshold": 2}))
    async with httpx.AsyncClient() as c:
        r = await ask(c, gw, marker())
    assert openai_error(r)["code"] == "upstream_disconnected"
    replica = gw.runtime.pools["p"].replicas["r0"]
    assert replica.breaker.state is BreakerState.OPEN and not replica.available
    assert len(srv.deliveries) == 2  # the third attempt found the circuit open


async def test_canary_no_answer_reaches_the_wrong_client(transport: str, hostile, gateway):
    srv = await hostile("canary")
    gw = await gateway(hostile_settings([srv.url], transport, upstream={"first_byte_timeout_s": 5}))
    marks = [marker() for _ in range(120)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32), timeout=10) as c:
        results = await asyncio.gather(*(ask(c, gw, m, stream=i % 3 == 0) for i, m in enumerate(marks)))
    ok = 0
    for i, (mark, r) in enumerate(zip(marks, results, strict=True)):
        if r.status_code == 200:
            assert answer_marker(r, i % 3 == 0) == mark, "an answer reached the wrong client"
            assert mark in r.text and r.text.count("m-") == r.text.count(mark)
            ok += 1
        else:
            openai_error(r)
        assert srv.markers().count(mark) <= MAX_ATTEMPTS
    assert ok >= len(marks) * 0.95
    await assert_settled(gw)


@pytest.mark.parametrize("echo", [True, False], ids=["echoes-request-id", "no-echo"])
async def test_stray_answer_after_the_request_went_out_never_reaches_it(
    transport: str, echo: bool, hostile, gateway
):
    """Issue 26's first item: an engine's second answer that arrives on a reused connection once
    the next request was written is that request's answer for every check of the socket; only the
    request id it carries (or not reusing the connection) tells them apart."""
    srv = await hostile("stray-before-answer", echo=echo)
    gw = await gateway(hostile_settings([srv.url], transport, upstream={"first_byte_timeout_s": 5}))
    marks = [marker() for _ in range(40)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8), timeout=10) as c:
        results = await asyncio.gather(*(ask(c, gw, m, stream=i % 2 == 0) for i, m in enumerate(marks)))
    for i, (mark, r) in enumerate(zip(marks, results, strict=True)):
        assert r.status_code == 200, r.text
        assert answer_marker(r, i % 2 == 0) == mark, "an answer reached the wrong client"
    if echo:  # connections were reused, and each stray answer cost its request a fresh one
        assert any(d.index > 0 for d in srv.deliveries)
    else:
        assert all(d.index == 0 for d in srv.deliveries)
    await assert_settled(gw)


async def test_a_stray_answers_request_is_resent_on_a_connection_never_used_before(
    transport: str, hostile, gateway, caplog: pytest.LogCaptureFixture
):
    """Issue 35: on the aiohttp transport the resend went through aiohttp's pool, which could hand
    it another doubtful connection (1-2 requests in 1,000 got a 502)."""
    caplog.set_level(logging.INFO, "kvgate.access")
    srv = await hostile("stray-before-answer")
    gw = await gateway(hostile_settings([srv.url], transport, upstream={"first_byte_timeout_s": 5}))
    async with httpx.AsyncClient(timeout=10) as c:
        first, second = marker(), marker()
        assert answer_marker(await ask(c, gw, first), False) == first
        assert answer_marker(await ask(c, gw, second), False) == second
    sent = [d for d in srv.deliveries if d.marker == second]
    assert len(sent) == 2 and sent[0].index == 1  # on the first's connection: the stray came
    lines = [r.fields for r in caplog.records if r.name == "kvgate.access"]  # type: ignore[attr-defined]
    assert [line.get("resent") for line in lines] == [None, 1]  # said, not silent
    assert sent[1].index == 0 and sent[1].connection not in {d.connection for d in srv.deliveries[:-1]}
    await assert_settled(gw)


async def test_idle_engine_connections_close_after_keepalive_s(transport: str, hostile, gateway):
    """Issue 35: idle connections to an engine (up to 512 of them) never expired."""
    srv = await hostile("ok")
    gw = await gateway(hostile_settings([srv.url], transport, upstream={"keepalive_s": 0.3}))
    async with httpx.AsyncClient(timeout=10) as c:
        await ask(c, gw, marker())
        await ask(c, gw, marker())
    assert srv.connections_used() == 1  # kept alive between the two
    used = srv.deliveries[0].connection
    await wait_until(lambda: used in srv.closed, timeout=STARTUP_S, what="the idle connection to close")
    await assert_settled(gw)
