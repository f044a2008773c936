"""What an HTTP client sees of the data plane's server is the same on both (`server.impl`):
HEAD, 404 and 405 in the OpenAI form, Expect: 100-continue, HTTP/1.0, chunked request bodies,
percent-encoded model ids, and a streamed answer's chunked framing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from gateway.server import RunningGateway
from tests.conftest import SERVER_IMPLS, gateway_settings
from tests.rawhttp import exchange, post, read_response

BODY = orjson.dumps({"model": "org/m", "prompt": "x"})


@pytest.fixture(params=SERVER_IMPLS)
def server_impl(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def gw(upstreams, gateway) -> AsyncIterator[RunningGateway]:
    (up,) = await upstreams(1)
    yield await gateway(gateway_settings([up.url], pool={"model": "org/m"}))


async def test_head_answers_the_headers_of_get_without_a_body(gw):
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: gw\r\n\r\nGET /live HTTP/1.1\r\nHost: gw\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    # No body after the HEAD answer: the next bytes are the pipelined GET's answer.
    live = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert live.status == 200 and live.json() == {"status": "ok"}


async def test_unknown_paths_and_methods_get_the_openai_error_form(gw):
    missing = await exchange(gw.port, b"GET /v2/nothing HTTP/1.1\r\nHost: gw\r\n\r\n")
    wrong = await exchange(gw.port, b"GET /v1/completions HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert missing.status == 404 and missing.json()["error"]["code"] == "not_found"  # type: ignore[index]
    assert wrong.status == 405 and wrong.json()["error"]["code"] == "method_not_allowed"  # type: ignore[index]
    assert "POST" in (wrong.header("allow") or "")


async def test_expect_100_continue_and_chunked_bodies(gw):
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    head = "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\n"
    writer.write(f"{head}Content-Length: {len(BODY)}\r\n\r\n".encode())
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 100")
    writer.write(BODY)
    assert (await asyncio.wait_for(read_response(reader), 5)).status == 200
    half = len(BODY) // 2
    chunked = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (half, BODY[:half], len(BODY) - half, BODY[half:])
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
    answer = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert answer.status == 200 and answer.json()["model"] == "org/m"  # type: ignore[index]


async def test_http10_is_answered_and_closed(gw):
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"GET /live HTTP/1.0\r\n\r\n")
    answer = await asyncio.wait_for(read_response(reader), 5)
    assert answer.status == 200
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the answer
    writer.close()


async def test_percent_encoded_model_ids_and_streamed_answers(gw):
    card = await exchange(gw.port, b"GET /v1/models/org%2Fm HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert card.status == 200 and card.json()["id"] == "org/m"  # type: ignore[index]
    streamed = await exchange(
        gw.port, post("/v1/completions", orjson.dumps({"model": "org/m", "stream": True}))
    )
    assert streamed.status == 200 and streamed.header("transfer-encoding") == "chunked"
    assert streamed.body.rstrip().endswith(b"data: [DONE]")


async def test_a_body_refused_before_it_is_read_still_gets_its_answer(gw):
    # 413 from the declared length while the client is still sending: the rest is read and
    # dropped, so the client reads the answer rather than a reset.
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/completions", content=b"x" * (9 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_many_pipelined_requests_are_all_answered(gw):
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"GET /live HTTP/1.1\r\nHost: gw\r\n\r\n" * 60)  # beyond what is parsed ahead
    answers = [await asyncio.wait_for(read_response(reader), 5) for _ in range(60)]
    writer.close()
    assert [a.status for a in answers] == [200] * 60
