"""The whole gateway against a hostile engine (tests/hostile_upstream.py), one case per
misbehaviour, for every transport.

Each case gets a clean OpenAI-shaped error or the right answer, reaches the engine the right
number of times, leaves no load, probe or connection slot behind, and the gateway then
serves the next request correctly. One gateway and one engine per transport serve every case
in turn, so each case also runs over a pool that earlier hostile answers went through.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
import pytest_asyncio

from gateway.fleet.breaker import BreakerState
from gateway.server import RunningGateway, start_gateway
from tests.conftest import SERVER_IMPLS, with_server_impl
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
    sse_events,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass(frozen=True)
class Case:
    mode: str
    stream: bool
    status: int
    code: str | None  # the gateway's error code; None: the engine's answer
    deliveries: int | tuple[int, ...]  # several: it depends on whether the error comes with the head


CASES = [
    Case("ok", False, 200, None, 1),
    Case("ok", True, 200, None, 1),
    Case("close", False, 502, "upstream_disconnected", MAX_ATTEMPTS),
    Case("reset", False, 502, "upstream_disconnected", MAX_ATTEMPTS),
    Case("close-mid-head", False, 502, "upstream_disconnected", MAX_ATTEMPTS),
    Case("close-mid-body", False, 502, "upstream_disconnected", 1),
    Case("close-mid-stream", True, 200, "upstream_stream_error", 1),
    Case("extra-response", False, 200, None, 1),
    Case("extra-response-later", False, 200, None, 1),
    Case("informational", False, 200, None, 1),
    Case("informational", True, 200, None, 1),
    Case("huge-head", False, 502, "upstream_bad_response", MAX_ATTEMPTS),
    Case("many-headers", False, 502, "upstream_bad_response", MAX_ATTEMPTS),
    Case("huge-body-declared", False, 502, "upstream_response_too_large", 1),
    Case("huge-body-chunked", False, 502, "upstream_response_too_large", 1),
    Case("garbage-status", False, 502, "upstream_bad_response", MAX_ATTEMPTS),
    Case("bad-header-bytes", False, 502, "upstream_bad_response", MAX_ATTEMPTS),
    # A framing error after a good head fails the answer; one parsed together with the head (as
    # aiohttp does when both came in one segment) is a bad answer, and another try may follow.
    Case("bad-chunk", False, 502, "upstream_bad_response", (1, MAX_ATTEMPTS)),
    Case("cl-and-te", False, 502, "upstream_bad_response", MAX_ATTEMPTS),
    Case("switching", False, 502, "upstream_bad_response", MAX_ATTEMPTS),
    Case("zero-status", False, 502, "upstream_bad_response", MAX_ATTEMPTS),
    Case("stall-head", False, 504, "upstream_timeout", 1),
    Case("stall-body", False, 504, "upstream_timeout", 1),
    Case("stall-body", True, 200, "upstream_stream_error", 1),
    Case("slow-drip", False, 200, None, 1),
    Case("gzip", False, 200, None, 1),
    Case("gzip-error", False, 400, None, 1),
    Case("status-503", False, 503, None, MAX_ATTEMPTS),
    Case("http10", False, 200, None, 1),
]


@dataclass
class Rig:
    srv: HostileUpstream
    gw: RunningGateway
    client: httpx.AsyncClient


@pytest_asyncio.fixture(
    loop_scope="module",
    scope="module",
    params=list(itertools.product(TRANSPORTS, SERVER_IMPLS)),
    ids=lambda p: "-".join(p),
)
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    transport, impl = request.param
    srv = await HostileUpstream().start()
    # Each case spends retries; a generous budget keeps them independent of the cases before.
    settings = hostile_settings([srv.url], transport, retry={"budget_ratio": 10})
    gw = await start_gateway(with_server_impl(settings, impl))
    async with httpx.AsyncClient(timeout=10) as client:
        yield Rig(srv, gw, client)
    await gw.stop()
    await srv.stop()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.mode}{'-stream' if c.stream else ''}")
async def test_hostile_engine_case(case: Case, rig: Rig):
    srv, gw, c = rig.srv, rig.gw, rig.client
    srv.mode = case.mode
    srv.deliveries.clear()
    mark = marker()
    r = await ask(c, gw, mark, case.stream)
    assert r.status_code == case.status, r.text
    if case.code == "upstream_stream_error":
        last = orjson.loads(sse_events(r)[-1])["error"]
        assert last["code"] == "upstream_stream_error"
        message = last["message"]
        assert message.count(message[:16]) == 1, message  # said once, not "x: x"
        assert answer_marker(r, True) == mark and "[DONE]" not in r.text
    elif case.code is not None:
        assert openai_error(r)["code"] == case.code
    elif case.status == 200:
        assert answer_marker(r, case.stream) == mark
        if case.stream:
            assert sse_events(r)[-1] == "[DONE]"
    else:
        # The engine's own error in the gateway's shape: its kind ("server_error") as the code.
        assert openai_error(r)["code"] == "server_error"
    allowed = case.deliveries if isinstance(case.deliveries, tuple) else (case.deliveries,)
    assert set(srv.markers()) == {mark} and len(srv.markers()) in allowed
    await assert_settled(gw)
    # The gateway keeps serving over the same pool, with the answer meant for this request.
    srv.mode = "ok"
    again = marker()
    r = await ask(c, gw, again, case.stream)
    assert r.status_code == 200 and answer_marker(r, case.stream) == again
    assert srv.markers()[-1] == again and srv.markers().count(again) == 1
    assert gw.runtime.pools["p"].replicas["r0"].breaker.state is BreakerState.CLOSED
    await assert_settled(gw)
