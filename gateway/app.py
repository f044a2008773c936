"""The HTTP surface: OpenAI routes, model list, liveness and readiness, error shaping."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from gateway.admin import register_admin
from gateway.api_routes import ApiRoutes
from gateway.dashboard import Dashboard
from gateway.errors import GatewayError, error_body
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
        message = f"{request.method} {request.path}: {exc.reason}"
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


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    pools = rt.ready()
    ok = bool(pools) and all(pools.values()) and not rt.draining
    return _json({"ready": ok, "draining": rt.draining, "pools": pools}, status=200 if ok else 503)


def build_app(runtime: Runtime) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=runtime.settings.server.max_body_bytes)
    app[RUNTIME] = runtime
    proxy = Proxy(runtime)
    for path in ENDPOINTS:
        app.router.add_post(path, proxy.handle)
    app.router.add_routes(ApiRoutes(runtime).routes())
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    if runtime.metrics is not None:
        app.router.add_get("/metrics", runtime.metrics.handle)
    app.router.add_routes(Dashboard(runtime).routes())
    register_admin(app, runtime)
    return app
