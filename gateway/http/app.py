"""The data plane's HTTP surface: OpenAI routes, model list, liveness and readiness, the envelope of
every inference request (its ids, record and span). Served by either HTTP server (gateway/http/)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gateway.config import ServerConfig
from gateway.errors import GatewayError, client_error, model_not_found
from gateway.fleet.pool import Pool
from gateway.http.api_routes import ApiRoutes
from gateway.http.auth import Auth
from gateway.http.handling import error_response, new_record
from gateway.http.request_body import read_body
from gateway.http.tenant_caps import TenantCaps
from gateway.logs import clip
from gateway.path.exchange import Exchange, Reply, Route, StreamOut, json_reply
from gateway.path.proxy import Proxy
from gateway.path.request_record import Observer
from gateway.path.sanitize import invalid_header
from gateway.path.trace import Tracer
from gateway.prompt.endpoints import PATHS
from gateway.routing.rollout import Rollouts

log = logging.getLogger(__name__)


async def live(ex: Exchange) -> Reply:
    """Liveness: 200 while the process serves HTTP, draining included (`/health` is the same)."""
    return json_reply({"status": "ok"})


class DataPlane:
    """The OpenAI routes (inference, the model list, the tokenizer) and the readiness probes of one
    gateway."""

    def __init__(
        self,
        server: ServerConfig,
        proxy: Proxy,
        api: ApiRoutes,
        auth: Auth,
        observe: Observer,
        tracer: Tracer,
        routes: Rollouts,
        pools: Mapping[str, Pool],
        draining: Callable[[], bool],
        caps: TenantCaps,
    ) -> None:
        self.server = server
        self.caps = caps
        self.proxy = proxy
        self.api = api
        self.auth = auth
        self.observe = observe  # every request's record, at its end
        self.tracer = tracer
        self.routes = routes
        self.pools = pools
        self.draining = draining

    def http_routes(self) -> list[Route]:
        """The data plane's routes (metrics and the status page are added by the runtime)."""
        return [
            *(Route("POST", path, self.inference) for path in PATHS),
            *self.api.routes(),
            Route("GET", "/live", live),
            Route("GET", "/health", live),
            Route("GET", "/ready", self.ready),
            Route("GET", "/ready/", self.ready_model, tail="model"),
        ]

    # -- inference ----------------------------------------------------------------------------
    async def inference(self, request: Exchange) -> Reply | StreamOut:
        """The envelope of an inference request: its ids and record, its span, its error form."""
        rec = new_record(request, PATHS[request.path])
        root = self.tracer.request(request.method, request.path, request.headers, rec)
        try:
            bad_header = invalid_header(request.headers)
            if bad_header is not None:
                raise client_error(
                    f"header {clip(bad_header, 64)!r}: values may hold only visible ASCII, spaces and tabs",
                    "invalid_header",
                )
            caller = self.auth.client(request)
            rec.tenant = caller.tenant
            server = self.server
            with self.caps.hold(caller.holder):
                raw = await read_body(request, server)
                response = await self.proxy.handle(request, raw, caller.tenant, rec)
        except GatewayError as exc:
            response = error_response(exc, rec)
        except asyncio.CancelledError:
            if not rec.completed:  # a client that closes after the end of its stream got its answer
                rec.client_disconnected = True
                rec.status = 499  # nginx's "client closed request": nobody received an answer
            raise
        finally:
            rec.ended = time.perf_counter()
            self.observe(rec)
            root.end(rec)
        return response

    # -- probes -------------------------------------------------------------------------------
    def pools_ready(self) -> dict[str, bool]:
        return {name: pool.has_healthy() for name, pool in self.pools.items()}

    def is_ready(self, pools: dict[str, bool]) -> bool:
        """Whether the gateway can serve, by `server.ready` (never while draining)."""
        rule = self.server.ready
        if self.draining() or not pools:
            return False
        if rule == "any":
            return any(pools.values())
        if rule == "all":
            return all(pools.values())
        return all(pools.get(name, False) for name in rule)

    async def ready(self, request: Exchange) -> Reply:
        """Readiness of the gateway as a whole, by `server.ready` (default: any pool can serve)."""
        pools = self.pools_ready()
        ok = self.is_ready(pools)
        body = {"ready": ok, "draining": self.draining(), "rule": self.server.ready, "pools": pools}
        return json_reply(body, status=200 if ok else 503)

    async def ready_model(self, request: Exchange) -> Reply:
        """Readiness of one model (a route or a pool's model): some pool it reaches can serve."""
        model = request.params["model"]
        names = self.routes.pools_for(model)
        if names is None:
            raise model_not_found(model)
        pools = {name: self.pools[name].has_healthy() for name in names}
        draining = self.draining()
        ok = any(pools.values()) and not draining
        body = {"model": model, "ready": ok, "draining": draining, "pools": pools}
        return json_reply(body, status=200 if ok else 503)
