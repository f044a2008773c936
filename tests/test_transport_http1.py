"""The hot-path HTTP/1.1 client against real servers: reuse, stale connections, framing."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from gateway.http1 import ConnectError, ConnectionPool, ProtocolError

from tests.conftest import free_port


async def _read_all(resp) -> bytes:
    parts = []
    while chunk := await resp.readany():
        parts.append(chunk)
    return b"".join(parts)


@pytest.fixture
async def server():
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.headers.get("x-mode") == "chunked":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b"data: %d\n\n" % i)
            await resp.write_eof()
            return resp
        if request.headers.get("x-mode") == "close":
            return web.Response(body=body, headers={"Connection": "close"})
        return web.Response(body=body, headers={"X-Seen": request.headers.get("x-custom", "")})

    app = web.Application()
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=0.3)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_keep_alive_connection_is_reused(server):
    url = server
    pool = ConnectionPool(1.0)
    conns = []
    for i in range(3):
        resp = await pool.request("POST", url + "/echo", b"body%d" % i, {"x-custom": "v"})
        assert resp.status == 200 and resp.header("X-Seen") == "v"
        assert await _read_all(resp) == b"body%d" % i
        conns.append(resp._conn)
        resp.release()
    assert conns[0] is conns[1] is conns[2]
    pool.close()


async def test_chunked_body_is_decoded_and_content_type_parsed(server):
    url = server
    pool = ConnectionPool(1.0)
    resp = await pool.request("POST", url + "/echo", b"", {"x-mode": "chunked"})
    assert resp.content_type == "text/event-stream"
    assert await _read_all(resp) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    resp.release()
    pool.close()


async def test_connection_close_is_not_reused_and_stale_idle_is_replaced(server):
    url = server
    pool = ConnectionPool(1.0)
    resp = await pool.request("POST", url + "/echo", b"x", {"x-mode": "close"})
    first = resp._conn
    await _read_all(resp)
    resp.release()
    resp = await pool.request("POST", url + "/echo", b"y", {})
    assert resp._conn is not first
    await _read_all(resp)
    idle = resp._conn
    resp.release()
    # The server's keep-alive timeout (0.3 s) closes the idle connection; the next request
    # must transparently use a new one rather than fail.
    deadline = asyncio.get_running_loop().time() + 5
    while idle.transport is not None:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    resp = await pool.request("POST", url + "/echo", b"z", {})
    assert await _read_all(resp) == b"z"
    resp.release()
    pool.close()


async def test_refused_connection_is_a_connect_error():
    pool = ConnectionPool(1.0)
    with pytest.raises(ConnectError):
        await pool.request("POST", f"http://127.0.0.1:{free_port()}/x", b"", {})


async def test_truncated_response_is_a_protocol_error():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    pool = ConnectionPool(1.0)
    resp = await pool.request("POST", f"http://127.0.0.1:{port}/x", b"", {})
    assert resp.status == 200
    with pytest.raises(ProtocolError):
        await _read_all(resp)
    srv.close()
    await srv.wait_closed()
