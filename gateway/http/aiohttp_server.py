"""The data plane on aiohttp's HTTP server (`server.impl: aiohttp`): the same routes as the lean
server, adapted to aiohttp's requests and responses, and its refusals in the same form (the OpenAI
error shape; 414 for a request line, 431 for headers over the limits; 501 for a transfer coding
other than chunked; `100 Continue` only once the body is read)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.http_parser import RawRequestMessage
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.config import ServerConfig
from gateway.errors import error_body
from gateway.http.conn_guard import GuardedConnection, is_probe
from gateway.http.handling import failure_reply, route_error, unsupported_coding
from gateway.path.exchange import Handler, Reply, Route, StreamOut

AiohttpHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger(__name__)


def _probe(method: str, path: str) -> bool:
    return is_probe(method.encode(), path.encode(errors="surrogateescape"))


class AiohttpExchange:
    """An aiohttp request as route handlers see one."""

    __slots__ = ("content", "content_length", "expects_continue", "headers", "method", "path", "request")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.method = request.method
        self.path = request.path
        self.headers = request.headers
        self.content = request.content
        self.content_length = request.content_length
        self.expects_continue = request.headers.get("expect", "").lower() == "100-continue"

    async def send_continue(self) -> None:
        if self.expects_continue and not self.content.at_eof():
            self.expects_continue = False
            await self.request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    @property
    def params(self) -> Mapping[str, str]:
        return self.request.match_info

    async def stream(self, status: int, headers: dict[str, str]) -> StreamOut:
        out = web.StreamResponse(status=status, headers=headers)
        await out.prepare(self.request)
        return out


def _adapt(handler: Handler) -> AiohttpHandler:
    async def handle(request: web.Request) -> web.StreamResponse:
        ex = AiohttpExchange(request)
        try:
            result = await handler(ex)
        except Exception as exc:
            result = failure_reply(exc, ex)
        if isinstance(result, Reply):
            return web.Response(status=result.status, body=result.body, headers=result.headers)
        assert isinstance(result, web.StreamResponse)  # what AiohttpExchange.stream opened
        return result

    return handle


@web.middleware
async def connection_state(request: web.Request, handler: AiohttpHandler) -> web.StreamResponse:
    """Tell the connection guard when a connection is serving a request and when it is idle."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if not isinstance(conn, GuardedConnection):
        return await handler(request)
    conn.guard.request_started(conn)
    try:
        return await handler(request)
    finally:
        conn.guard.request_finished(conn)
        if isinstance(conn.inner, _Handler):
            conn.inner.answered(request)


async def _no_continue(request: web.Request) -> None:
    """aiohttp's default answers `Expect: 100-continue` before the handler runs (before the auth
    and size checks): `AiohttpExchange.send_continue` does it when the body is read instead."""


@web.middleware
async def transfer_codings(request: web.Request, handler: AiohttpHandler) -> web.StreamResponse:
    """A coding before chunked (`gzip, chunked`) that nothing here would undo: 501, as RFC 9112 says,
    and the connection closes (aiohttp read the body as chunked and left the rest as it was)."""
    coding = request.headers.get("transfer-encoding")
    if coding is None or not unsupported_coding(coding):
        return await handler(request)
    reply = route_error(
        501, f"unsupported Transfer-Encoding {coding[:40]!r}; only chunked", request.method, request.path
    )
    response = web.Response(status=reply.status, body=reply.body, headers=reply.headers)
    response.force_close()
    return response


class _Handler(RequestHandler):
    """aiohttp's connection protocol with its refusals of malformed requests in the OpenAI error
    form, and the statuses the lean server gives them: 414 for a request line over the limit, 431
    for a header line or count over it (aiohttp answers all three 400, in plain text)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Requests read and not yet answered, counted where aiohttp's queue cannot tell (a request
        # taken off the queue is not yet its current one): probes, and everything else.
        self.probes = 0
        self.others = 0

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        super().data_received(data)
        for message, _ in itertools.islice(self._messages, queued, None):
            probe = isinstance(message, RawRequestMessage) and _probe(message.method, message.path)
            self.probes += probe
            self.others += not probe

    def answered(self, request: web.Request) -> None:
        if _probe(request.method, request.path):
            self.probes -= 1
        else:
            self.others -= 1

    # aiohttp types it `-> None`; asyncio.Protocol's True keeps the write side open.
    def eof_received(self) -> bool | None:  # type: ignore[override]
        """A probe sent and then half-closed (`printf 'GET /health ...' | nc -N`) still gets its
        answer, as on the lean server, and the connection closes after it. Anything else: the
        client has left, and the transport's close cancels what is in progress for it."""
        if self.others or not self.probes:
            return None
        self.close()  # once the probes are answered
        return True

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400 or not isinstance(exc, BadHttpMessage):
            return super().handle_error(request, status, exc, message)
        log.debug("refused a client request: %s", exc)  # the client's doing: not above debug
        text = str(exc.message)
        if isinstance(exc, LineTooLong):  # its first argument: the start of the line that was too long
            line = bytes(exc.args[0]) if isinstance(exc.args[0], bytes | bytearray) else b""
            status = 414 if line.startswith((b"/", b"http:", b"https:", b"*")) else 431
        elif text == "Too many headers received":
            status = 431
        body = error_body(f"malformed HTTP request: {text}", "invalid_request_error", "invalid_http_request")
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


@web.middleware
async def route_errors(request: web.Request, handler: AiohttpHandler) -> web.StreamResponse:
    """aiohttp's own refusals (no such route, wrong method) in the OpenAI error form."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reply = route_error(exc.status, exc.reason, request.method, request.path)
        if "Allow" in exc.headers:  # a 405 names the methods the path takes
            reply.headers["Allow"] = exc.headers["Allow"]
        return web.Response(status=reply.status, body=reply.body, headers=reply.headers)


def application(routes: list[Route], server: ServerConfig) -> web.Application:
    app = web.Application(
        middlewares=[connection_state, route_errors, transfer_codings], client_max_size=server.max_body_bytes
    )
    for route in routes:
        path = route.path if route.tail is None else f"{route.path}{{{route.tail}:.+}}"
        handler = _adapt(route.handler)
        if route.method == "GET":
            app.router.add_get(path, handler, expect_handler=_no_continue)  # HEAD too
        else:
            app.router.add_route(route.method, path, handler, expect_handler=_no_continue)
    return app


class AiohttpServer:
    """aiohttp's server behind the connection guard: `factory` makes each connection's protocol."""

    def __init__(self, routes: list[Route], server: ServerConfig) -> None:
        self.runner = web.AppRunner(
            application(routes, server),
            handler_cancellation=True,  # a client that leaves cancels its handler and so the upstream call
            access_log=None,
            shutdown_timeout=server.grace_period_s,
            # The connection guard closes idle connections (and counts them); aiohttp's own timer is a
            # backstop that must not beat it.
            keepalive_timeout=server.keepalive_timeout_s + 5.0,
            auto_decompress=False,  # request bodies are decoded, within bounds, by request_body
        )

    async def setup(self) -> None:
        await self.runner.setup()

    def factory(self) -> asyncio.Protocol:
        server = self.runner.server
        assert server is not None
        # web.Server's own call, with the protocol class that answers malformed requests as above.
        return _Handler(server, loop=server._loop, **server._kwargs)

    async def shutdown(self) -> None:
        """Let requests in flight finish within the grace period, then close every connection."""
        await self.runner.cleanup()
