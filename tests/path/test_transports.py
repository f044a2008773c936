"""The transport seam (gateway/path/upstream.py over gateway/path/transports/) for every transport,
against real servers on loopback: keep-alive reuse, stale and closed connections, refused
connects, request header validation, the per-host connection cap, and TLS."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from shutil import which

import httpx
import pytest
from aiohttp import web

from gateway.config import ConfigError, UpstreamConfig, load_config, parse_target
from gateway.path.transports.base import HostSlots, InvalidHeaderError, header_block
from gateway.path.upstream import Upstream, UpstreamError
from tests.conftest import free_port, wait_until
from tests.hostile_upstream import TRANSPORTS, HostileUpstream, ask, hostile_settings, marker, openai_error

JSON = {"Content-Type": "application/json"}


@pytest.fixture(params=TRANSPORTS)
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[Upstream]:
    up = Upstream(UpstreamConfig(transport=request.param, first_byte_timeout_s=2))
    yield up
    await up.close()


@pytest.fixture
async def echo() -> AsyncIterator[str]:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.headers.get("x-mode") == "close":
            return web.Response(body=body, headers={"Connection": "close"})
        return web.Response(body=body, headers={"X-Seen": request.headers.get("x-custom", "")})

    app = web.Application()
    app.router.add_post("/echo", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    await runner.cleanup()


async def post(
    up: Upstream, url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    sent = {**JSON, "X-Request-Id": os.urandom(8).hex(), **(headers or {})}  # as the proxy sends
    resp = await up.open("POST", url, body, sent)
    try:
        return resp.status, await up.read(resp)
    finally:
        resp.release()


async def test_keep_alive_connection_is_reused(upstream: Upstream):
    srv = await HostileUpstream("ok").start()
    try:
        for i in range(3):
            status, body = await post(upstream, srv.url + "/v1/completions", b'{"prompt": "p%d"}' % i)
            assert status == 200 and b'"text":"p%d"' % i in body
        assert srv.connections_used() == 1
    finally:
        await srv.stop()


async def test_engine_that_does_not_echo_the_request_id_gets_a_connection_per_request(upstream: Upstream):
    srv = await HostileUpstream("ok", echo=False).start()
    try:
        for i in range(3):
            status, body = await post(upstream, srv.url + "/v1/completions", b'{"prompt": "p%d"}' % i)
            assert status == 200 and b'"text":"p%d"' % i in body
        # Its answers cannot be proved to be their requests' on a reused connection: none is reused,
        # and the engine is asked to close (so that its side keeps the TIME_WAIT).
        assert srv.connections_used() == 3
        assert {d.headers.get("connection") for d in srv.deliveries} == {"close"}
    finally:
        await srv.stop()


async def test_unverified_reuse_only_when_configured():
    up = Upstream(UpstreamConfig(first_byte_timeout_s=2, reuse_unverified_connections=True))
    srv = await HostileUpstream("ok", echo=False).start()
    try:
        for i in range(3):
            assert (await post(up, srv.url + "/v1/completions", b'{"prompt": "p%d"}' % i))[0] == 200
        assert srv.connections_used() == 1
    finally:
        await srv.stop()
        await up.close()


async def test_connection_close_is_honoured(upstream: Upstream, echo: str):
    status, body = await post(upstream, echo + "/echo", b"x", {"x-mode": "close"})
    assert (status, body) == (200, b"x")
    status, body = await post(upstream, echo + "/echo", b"y", {"x-custom": "v"})
    assert (status, body) == (200, b"y")


async def test_engine_closing_idle_connections_costs_nothing(upstream: Upstream):
    srv = await HostileUpstream("close-after-answer").start()
    try:
        for i in range(3):  # whether the FIN comes before the next request or crosses it
            status, body = await post(upstream, srv.url + "/v1/completions", b'{"prompt": "p%d"}' % i)
            assert status == 200 and b'"text":"p%d"' % i in body
        assert srv.markers() == ["p0", "p1", "p2"]
    finally:
        await srv.stop()


async def test_refused_connection_is_unreachable_and_sent_nowhere(upstream: Upstream):
    with pytest.raises(UpstreamError) as info:
        await upstream.open("POST", f"http://127.0.0.1:{free_port()}/x", b"", JSON)
    err = info.value
    assert (err.status, err.code, err.sent, err.retryable, err.replica_fault) == (
        502,
        "upstream_unreachable",
        0,
        True,
        True,
    )
    assert not any(upstream.slots._used.values())


@pytest.mark.parametrize(
    "name, value",
    [
        ("x-a", "1\r\nx-injected: 1"),
        ("x-a", "1\nGET / HTTP/1.1"),
        ("x-a", "nul\x00"),
        ("x-a", "€"),
        ("x a", "space in name"),
        ("Content-Length", "0"),
        ("Transfer-Encoding", "chunked"),
        ("host", "elsewhere"),
        ("Connection", "close"),
    ],
)
async def test_headers_that_would_change_the_request_are_refused_before_sending(
    upstream: Upstream, name: str, value: str
):
    srv = await HostileUpstream("ok").start()
    try:
        with pytest.raises(UpstreamError) as info:
            await upstream.open("POST", srv.url + "/v1/completions", b"{}", {**JSON, name: value})
        assert (info.value.status, info.value.code, info.value.replica_fault) == (
            400,
            "invalid_header",
            False,
        )
        assert srv.deliveries == [] and not any(upstream.slots._used.values())
    finally:
        await srv.stop()


def test_header_block_is_exactly_the_headers():
    assert header_block({"A": "1", "x-b": "two words\tand a tab", "x-c": "café"}) == (
        "A: 1\r\nx-b: two words\tand a tab\r\nx-c: café\r\n"
    )
    with pytest.raises(InvalidHeaderError, match="x-bad"):
        header_block({"ok": "1", "x-bad": "a\rb"})


@pytest.mark.parametrize(
    "url", ["ftp://h/x", "http:///x", "http://h:99999/x", "http://h/a b", "http://h/a\r\nb", "http://h/\x7f"]
)
def test_unusable_engine_urls_are_refused_by_the_config(url: str):
    with pytest.raises(ValueError):
        parse_target(url)
    with pytest.raises(ConfigError, match=r"pools\.0\.endpoints\.0\.url"):
        load_config(None, {"pools": [{"name": "p", "model": "m", "endpoints": [{"url": url}]}]})


def test_targets_know_their_origin_and_host_header():
    t = parse_target("https://[::1]:8443/v1/x?y=1")
    assert (t.origin, t.host_header, t.path, t.tls) == (
        ("https", "::1", 8443),
        "[::1]:8443",
        "/v1/x?y=1",
        True,
    )
    assert parse_target("http://example").port == 80


async def test_host_slots_cap_wait_in_order_and_survive_cancelled_waiters():
    slots = HostSlots(2)
    origin = ("http", "h", 1)
    a, b = await slots.acquire(origin), await slots.acquire(origin)
    assert slots.try_acquire(origin) is None
    first = asyncio.ensure_future(slots.acquire(origin))
    gone = asyncio.ensure_future(slots.acquire(origin))
    last = asyncio.ensure_future(slots.acquire(origin))
    await asyncio.sleep(0)
    gone.cancel()
    a.release()
    a.release()  # idempotent
    got_first = await first
    assert not last.done() and slots.in_use(origin) == 2
    b.release()
    got_last = await last
    got_first.release()
    got_last.release()
    assert slots.in_use(origin) == 0 and slots.try_acquire(origin) is not None


async def test_connection_cap_per_host_is_real(transport: str, gateway):
    srv = await HostileUpstream("hold").start()
    try:
        cap = {"max_connections": 2, "first_byte_timeout_s": 10}
        gw = await gateway(hostile_settings([srv.url], transport, upstream=cap))
        waiters = gw.runtime.upstream.slots._waiters
        async with httpx.AsyncClient(timeout=10) as c:
            pending = [asyncio.create_task(ask(c, gw, marker())) for _ in range(5)]
            await wait_until(
                lambda: srv.held == 2 and sum(map(len, waiters.values())) == 3,
                what="2 requests sent, 3 waiting",
            )
            srv.release.set()
            assert [r.status_code for r in await asyncio.gather(*pending)] == [200] * 5
        assert srv.connections_used() == 2
    finally:
        await srv.stop()


async def test_waiting_for_a_connection_is_bounded_by_the_first_byte_timeout(transport: str, gateway):
    srv = await HostileUpstream("stall-body").start()  # a stream that holds its connection
    try:
        limits = {"max_connections": 1, "first_byte_timeout_s": 0.3, "idle_timeout_s": 30}
        gw = await gateway(hostile_settings([srv.url], transport, upstream=limits))
        async with httpx.AsyncClient(timeout=10) as c:
            holder = asyncio.create_task(ask(c, gw, marker(), stream=True))
            await wait_until(lambda: len(srv.deliveries) == 1, what="the stream holding the connection")
            waiting = await ask(c, gw, marker())
            err = openai_error(waiting)
            assert waiting.status_code == 503 and err["code"] == "upstream_busy"
            assert "upstream.max_connections" in err["message"]
            assert len(srv.deliveries) == 1 and not holder.done()
            await srv.stop()  # cuts the holder's stream: it ends with an error event
            assert "upstream_stream_error" in (await holder).text
        assert gw.runtime.pools["p"].replicas["r0"].inflight_requests == 0
    finally:
        await srv.stop()


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


# -- TLS ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made here (openssl CLI; `cryptography` is not installed)."""
    if which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=kvgate-test",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
async def tls_engine(certificate: tuple[Path, Path]) -> AsyncIterator[HostileUpstream]:
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*certificate)
    srv = await HostileUpstream("ok", tls=ctx).start()
    yield srv
    await srv.stop()


async def test_https_engine_with_its_ca_file(
    transport: str, tls_engine: HostileUpstream, certificate, gateway
):
    settings = hostile_settings(
        [tls_engine.url], transport, upstream={"tls": {"ca_file": str(certificate[0])}}
    )
    settings.health.enabled = True  # health checks and load scrapes speak the same TLS
    gw = await gateway(settings)
    await wait_until(
        lambda: {"/health", "/metrics"} <= set(tls_engine.gets), what="a health check and a scrape"
    )
    mark = marker()
    async with httpx.AsyncClient() as c:
        r = await ask(c, gw, mark)
        s = await ask(c, gw, marker(), stream=True)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == mark
    assert s.status_code == 200 and s.text.endswith("data: [DONE]\n\n")
    assert tls_engine.url.startswith("https://") and tls_engine.connections_used() == 1
    assert gw.runtime.pools["p"].replicas["r0"].healthy


async def test_https_engine_with_an_unknown_certificate_is_refused_by_default(
    transport: str, tls_engine: HostileUpstream, gateway
):
    gw = await gateway(hostile_settings([tls_engine.url], transport))
    async with httpx.AsyncClient() as c:
        r = await ask(c, gw, marker())
    err = openai_error(r)
    assert r.status_code == 502 and err["code"] == "upstream_unreachable"
    assert "certificate" in err["message"].lower()
    assert tls_engine.deliveries == []


async def test_https_verification_off_only_when_asked(transport: str, tls_engine: HostileUpstream, gateway):
    gw = await gateway(hostile_settings([tls_engine.url], transport, upstream={"tls": {"verify": False}}))
    async with httpx.AsyncClient() as c:
        r = await ask(c, gw, marker())
    assert r.status_code == 200 and len(tls_engine.deliveries) == 1


def test_tls_settings_are_validated():
    with pytest.raises(ConfigError, match=r"upstream\.tls\.verify"):
        load_config(None, {"upstream": {"tls": {"verify": "sometimes"}}})
    with pytest.raises(ConfigError, match=r"upstream\.transport"):
        load_config(None, {"upstream": {"transport": "carrier-pigeon"}})
    assert load_config(None, {}).upstream.tls.verify is True
