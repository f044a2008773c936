"""The HTTP surface: OpenAI routes, model list, liveness and readiness, error shaping."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from gateway.admin import register_admin
from gateway.api_routes import ApiRoutes
from gateway.conn_guard import GuardedConnection
from gateway.dashboard import Dashboard
from gateway.errors import GatewayError, error_body
from gateway.logs import clip
from gateway.proxy import ENDPOINTS, Proxy
from gateway.runtime import Runtime

log = logging.getLogger(__name__)

RUNTIME = web.AppKey("runtime", Runtime)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


@web.middleware
async def connection_state(request: web.Request, handler: Handler) -> web.StreamResponse:
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
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Whatever goes wrong, the client gets the OpenAI error form, never a traceback."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return web.Response(
            status=exc.status, body=exc.body(), content_type="application/json", headers=exc.headers
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        message = f"{request.method} {clip(request.path)}: {exc.reason}"
        return web.Response(
            status=exc.status,
            body=error_body(message, "invalid_request_error", code),
            content_type="application/json",
        )
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.Response(
            status=500,
            body=error_body("internal gateway error", "server_error", "internal_error"),
            content_type="application/json",
        )


async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves HTTP, draining included (`/health` is the same)."""
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness of the gateway as a whole, by `server.ready` (default: any pool can serve)."""
    rt = request.app[RUNTIME]
    pools = rt.ready()
    ok = rt.is_ready(pools)
    body = {"ready": ok, "draining": rt.draining, "rule": rt.settings.server.ready, "pools": pools}
    return _json(body, status=200 if ok else 503)


async def ready_model(request: web.Request) -> web.Response:
    """Readiness of one model (a route or a pool's model): some pool it reaches can serve."""
    rt = request.app[RUNTIME]
    model = request.match_info["model"]
    names = rt.router.pools_for(model)
    if names is None:
        raise GatewayError(
            404, f"the model `{model}` does not exist", "invalid_request_error", "model_not_found", "model"
        )
    pools = {name: rt.pools[name].has_healthy() for name in names}
    ok = any(pools.values()) and not rt.draining
    body = {"model": model, "ready": ok, "draining": rt.draining, "pools": pools}
    return _json(body, status=200 if ok else 503)


def build_app(runtime: Runtime) -> web.Application:
    app = web.Application(
        middlewares=[connection_state, openai_errors], client_max_size=runtime.settings.server.max_body_bytes
    )
    app[RUNTIME] = runtime
    proxy = Proxy(runtime)
    for path in ENDPOINTS:
        app.router.add_post(path, proxy.handle)
    app.router.add_routes(ApiRoutes(runtime).routes())
    app.router.add_get("/live", live)
    app.router.add_get("/health", live)
    app.router.add_get("/ready", ready)
    app.router.add_get("/ready/{model:.+}", ready_model)
    if runtime.metrics is not None:
        app.router.add_get("/metrics", runtime.metrics.handle)
    app.router.add_routes(Dashboard(runtime).routes())
    register_admin(app, runtime)
    return app
