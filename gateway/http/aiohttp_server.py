"""The data plane on aiohttp's HTTP server (`server.impl: aiohttp`): the same routes as the lean
server, adapted to aiohttp's requests and responses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from gateway.config import ServerConfig
from gateway.http.conn_guard import GuardedConnection
from gateway.http.handling import failure_reply, route_error
from gateway.path.exchange import Handler, Reply, Route, StreamOut

AiohttpHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AiohttpExchange:
    """An aiohttp request as route handlers see one."""

    __slots__ = ("content", "content_length", "headers", "method", "path", "request")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.method = request.method
        self.path = request.path
        self.headers = request.headers
        self.content = request.content
        self.content_length = request.content_length

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
    app = web.Application(middlewares=[connection_state, route_errors], client_max_size=server.max_body_bytes)
    for route in routes:
        path = route.path if route.tail is None else f"{route.path}{{{route.tail}:.+}}"
        if route.method == "GET":
            app.router.add_get(path, _adapt(route.handler))  # HEAD too
        else:
            app.router.add_route(route.method, path, _adapt(route.handler))
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
        return server()

    async def shutdown(self) -> None:
        """Let requests in flight finish within the grace period, then close every connection."""
        await self.runner.cleanup()
