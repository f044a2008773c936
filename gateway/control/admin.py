"""The admin API under /admin/: route weights, drain, endpoints, config reload, rollout stats, as a
FastAPI app with typed request and response models, served on the control listener
(gateway.control.listener), never on the data plane's port.

Every /admin route needs the admin key (`Authorization: Bearer <control.admin_key>`), checked before
anything else looks at the request; the OpenAPI schema (`/openapi.json`) and its docs page (`/docs`,
Swagger UI from assets shipped in the `fastapi-offline` package, so it works without internet) are
open: they describe the API and hold no data. Errors come in the OpenAI form
(`{"error": {"message", "type", "param", "code"}}`). Every change is applied at once, logged with
who made it, and kept in a short audit trail (GET /admin/audit). A config reload
(gateway.control.reload) swaps routes, weights and pool endpoints in place without dropping a
request, and refuses (naming the keys) anything that needs a restart.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import EndpointConfig, RouteWeight
from gateway.control.audit import AuditTrail
from gateway.control.reload import Reloader, ReloadRejected
from gateway.control.state import StateBackend
from gateway.control.variant_stats import VariantStats
from gateway.errors import GatewayError, client_error, error_body
from gateway.fleet.fleet import Fleet
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.logs import clip
from gateway.routing.rollout import Rollouts

log = logging.getLogger(__name__)

AdminCheck = Callable[[Mapping[str, str]], None]

# Admin bodies are a few hundred bytes (weights, one endpoint); the bound is read before the key
# is known to be right, so it is small.
MAX_BODY_BYTES = 64 * 1024
# The admin API's own version (the schema's `info.version`), raised when a route or model changes
# incompatibly; the gateway's version is the status page's business.
API_VERSION = "1"
DOCS_URL = "/docs"
OPENAPI_URL = "/openapi.json"
# The docs page, its assets and the schema are open; the page runs only its own inline bootstrap
# and the bundled Swagger UI, and talks only to this origin.
_SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        b"img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        b"frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


# -- the models: what the OpenAPI schema shows ------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Model):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Model):
    """Every error, in the OpenAI form."""

    error: ErrorDetail


class MatchView(_Model):
    headers: dict[str, str]


class PoolWeightView(_Model):
    name: str
    weight: float
    adapter: str | None = Field(
        None, description="Present when the pool serves the route with a LoRA adapter"
    )


class StickyView(_Model):
    key: str
    salt: str


class RuleView(_Model):
    match: MatchView | None
    pools: list[PoolWeightView]
    sticky: StickyView | None
    rewrite_model: bool | None = Field(
        None, description="Present (false) when answers keep the engine's model name"
    )


class RoutesView(_Model):
    routes: dict[str, list[RuleView]] = Field(description="Each route's rules, in order")


# A number (not a string, not a bool) in the bounds the config file holds weights to; the router
# checks the rule as a whole (one weight positive).
Weight = Annotated[RouteWeight, Field(strict=True)]


class WeightsUpdate(_Model):
    weights: dict[str, Weight] = Field(
        min_length=1, description="{pool: weight}; pools left out keep theirs; weight 0 is a rollback"
    )
    rule: StrictInt | None = Field(None, description="The rule's index; default: the route's last rule")


class WeightsChange(_Model):
    model: str
    rule: int
    weights: dict[str, float]
    previous: dict[str, float]


class ReplicaView(_Model):
    name: str
    url: str
    role: str
    kind: str
    managed: bool = Field(description="Launched or discovered by the gateway: reloads and DELETE leave it")
    healthy: bool
    draining: bool
    available: bool = Field(description="Takes new requests: healthy, not draining, circuit not open")
    circuit: str
    inflight_requests: int
    inflight_tokens: int
    remote_inflight_requests: int = Field(description="In flight through other gateways (shared state)")
    remote_inflight_tokens: int
    total_requests: int

    @classmethod
    def of(cls, r: Replica) -> ReplicaView:
        return cls(
            name=r.name,
            url=r.url,
            role=r.role,
            kind=r.kind,
            managed=r.managed,
            healthy=r.healthy,
            draining=r.draining,
            available=r.available,
            circuit=str(r.circuit),
            inflight_requests=r.inflight_requests,
            inflight_tokens=r.inflight_tokens,
            remote_inflight_requests=r.remote_inflight_requests,
            remote_inflight_tokens=r.remote_inflight_tokens,
            total_requests=r.total_requests,
        )


class PoolView(_Model):
    model: str
    replicas: dict[str, ReplicaView]


class PoolsView(_Model):
    pools: dict[str, PoolView]


class RemovedReplica(_Model):
    removed: str
    inflight_requests: int = Field(description="Requests still in flight on it; they finish")


class ReloadResult(_Model):
    changes: list[str]


class AuditEntry(_Model):
    at: float = Field(description="Unix time")
    who: str = Field(description="The admin key's fingerprint and the caller's address, or SIGHUP")
    what: str


class AuditView(_Model):
    changes: list[AuditEntry] = Field(description="The latest changes, oldest first")


class StateStatus(_Model):
    """The shared state backend; the fields after `connected` are Redis's only."""

    backend: str
    connected: bool
    instance: str | None = None
    peers: int | None = None
    resyncs: int | None = None
    last_error: str | None = None


class VariantFigures(_Model):
    requests_total: int
    errors_total: int
    client_errors_total: int
    window_s: float
    window_requests: int
    window_error_rate: float | None
    ttft_ms: dict[str, float | None] = Field(description="Percentiles over the window: p50, p95, p99")
    e2e_ms: dict[str, float | None]


class Variant(_Model):
    weight: float | None = Field(description="Its weight in the split rule (the route's last)")
    share: float | None
    stats: VariantFigures | None


class RouteRollout(_Model):
    rules: list[RuleView]
    split_rule: int
    variants: dict[str, Variant]


class RolloutsView(_Model):
    routes: dict[str, RouteRollout]
    direct: dict[str, dict[str, VariantFigures]] = Field(
        description="Models asked for by a pool's own name: {model: {pool: figures}}"
    )
    state: StateStatus


def _error_response(exc: GatewayError) -> Response:
    return Response(exc.body(), exc.status, headers=exc.headers, media_type="application/json")


# -- the handlers -----------------------------------------------------------------------------------
class Admin:
    def __init__(
        self,
        fleet: Fleet,
        router: Rollouts,
        state: StateBackend,
        reloader: Reloader,
        audit: AuditTrail,
        variant_stats: VariantStats,
    ) -> None:
        self.fleet = fleet
        self.router = router
        self.state = state
        self.reloader = reloader
        self.audit = audit
        self.variant_stats = variant_stats

    def app(self, check_admin: AdminCheck) -> FastAPI:
        """The control plane's ASGI app: the /admin routes behind `check_admin`, the schema, the docs."""
        app = FastAPIOffline(
            title="kvgate control plane",
            version=API_VERSION,
            description=(
                "Operate a running kvgate gateway: route weights, rollout figures, pools and "
                "replicas, config reload, the audit trail. Every /admin route needs the admin key "
                "(`Authorization: Bearer <control.admin_key>`); errors come in the OpenAI form."
            ),
            docs_url=DOCS_URL,
            redoc_url=None,
            openapi_url=OPENAPI_URL,
            static_url=f"{DOCS_URL}/static",
            swagger_ui_parameters={"validatorUrl": None},  # it would send the schema to swagger.io
        )
        app.include_router(self._routes())
        app.add_exception_handler(GatewayError, _gateway_error)
        app.add_exception_handler(HTTPException, _http_error)
        app.add_exception_handler(RequestValidationError, _invalid_body)
        app.add_exception_handler(Exception, _internal_error)
        app.add_middleware(AdminGuard, check_admin=check_admin)
        app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
        return app

    def _routes(self) -> APIRouter:
        api = APIRouter(
            prefix="/admin",
            responses={"4XX": {"model": ErrorResponse, "description": "An error, in the OpenAI form"}},
        )
        pool_404: dict[int | str, dict[str, Any]] = {
            404: {"model": ErrorResponse, "description": "No such pool or replica"}
        }
        api.add_api_route(
            "/routes",
            self.routes,
            methods=["GET"],
            summary="Routes and their rules",
            tags=["rollouts"],
            response_model_exclude_unset=True,  # a pool's adapter, a rule's rewrite_model: when set
        )
        api.add_api_route(
            "/routes/{model:path}/weights",
            self.set_weights,
            methods=["PUT"],
            summary="Set a route rule's weights (effective for the next request)",
            tags=["rollouts"],
            responses={404: {"model": ErrorResponse, "description": "No such route or pool in the rule"}},
        )
        api.add_api_route(
            "/rollouts",
            self.rollouts,
            methods=["GET"],
            summary="Each route's variants with their weights, shares and figures",
            tags=["rollouts"],
            response_model_exclude_unset=True,
        )
        api.add_api_route(
            "/pools", self.pools, methods=["GET"], summary="Pools and their replicas", tags=["pools"]
        )
        api.add_api_route(
            "/pools/{pool}/replicas",
            self.add_replica,
            methods=["POST"],
            status_code=201,
            summary="Add an unmanaged replica to a pool",
            tags=["pools"],
            responses={**pool_404, 409: {"model": ErrorResponse, "description": "Already in the pool"}},
        )
        api.add_api_route(
            "/pools/{pool}/replicas/{replica}",
            self.remove_replica,
            methods=["DELETE"],
            summary="Remove an unmanaged replica (requests in flight on it finish)",
            tags=["pools"],
            responses={**pool_404, 409: {"model": ErrorResponse, "description": "A managed replica"}},
        )
        for action, handler in (("drain", self.drain), ("undrain", self.undrain)):
            api.add_api_route(
                f"/pools/{{pool}}/replicas/{{replica}}/{action}",
                handler,
                methods=["POST"],
                summary=handler.__doc__,
                tags=["pools"],
                responses=pool_404,
            )
        api.add_api_route(
            "/reload",
            self.reload,
            methods=["POST"],
            summary="Re-read the config file and apply routes, weights and endpoints (also on SIGHUP)",
            tags=["gateway"],
            responses={409: {"model": ErrorResponse, "description": "Rejected: nothing was applied"}},
        )
        api.add_api_route(
            "/audit", self.audit_trail, methods=["GET"], summary="Who changed what", tags=["gateway"]
        )
        api.add_api_route(
            "/state",
            self.state_status,
            methods=["GET"],
            summary="The shared state backend",
            tags=["gateway"],
            response_model_exclude_unset=True,
        )
        return api

    def who(self, request: Request) -> str:
        # The admin key is one shared secret: name it by a fingerprint, never by the key itself.
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        key_id = hashlib.sha256(token.encode()).hexdigest()[:8]
        client = request.client.host if request.client is not None else "?"
        return f"admin key {key_id} from {client}"

    def _pool(self, name: str) -> Pool:
        pool = self.fleet.pools.get(name)
        if pool is None:
            raise client_error(f"no pool {clip(name, 64)!r}", "pool_not_found", status=404)
        return pool

    def _replica(self, pool_name: str, name: str) -> Replica:
        pool = self._pool(pool_name)
        replica = pool.replicas.get(name)
        if replica is None:
            raise client_error(
                f"pool {pool.name!r} has no replica {clip(name, 64)!r}", "replica_not_found", status=404
            )
        return replica

    async def routes(self) -> RoutesView:
        return RoutesView.model_validate({"routes": self.router.describe()})

    async def set_weights(self, request: Request, model: str, update: WeightsUpdate) -> WeightsChange:
        router = self.router
        try:
            before = router.weights(model, update.rule)
            index = router.set_weights(model, update.weights, update.rule)
        except KeyError as exc:
            raise client_error(str(exc.args[0]), "route_not_found", status=404) from None
        except ValueError as exc:
            raise client_error(str(exc), "invalid_weights", param="weights") from None
        after = router.weights(model, index)
        who = self.who(request)
        self.audit.record(who, f"route {model} rule {index} weights {before} -> {after}")
        await self.state.publish_weights(model, index, after, who)
        return WeightsChange(model=model, rule=index, weights=after, previous=before)

    async def pools(self) -> PoolsView:
        return PoolsView(
            pools={
                name: PoolView(
                    model=pool.model,
                    replicas={r.name: ReplicaView.of(r) for r in pool.replicas.values()},
                )
                for name, pool in self.fleet.pools.items()
            }
        )

    async def add_replica(self, request: Request, pool: str, endpoint: EndpointConfig) -> ReplicaView:
        target = self._pool(pool)
        if any(r.url == endpoint.url for r in target.replicas.values()):
            raise client_error(
                f"pool {target.name!r} already has {endpoint.url}", "replica_exists", status=409
            )
        try:
            replica = self.fleet.add_endpoint(target, endpoint)
        except ValueError as exc:
            raise client_error(str(exc), "replica_exists", status=409) from None
        who = self.who(request)
        self.audit.record(who, f"pool {target.name}: added replica {replica.name} at {replica.url}")
        await self.state.publish_endpoint(target.name, endpoint.url, endpoint.model_dump(), who)
        return ReplicaView.of(replica)

    async def remove_replica(self, request: Request, pool: str, replica: str) -> RemovedReplica:
        target = self._pool(pool)
        r = self._replica(pool, replica)
        if r.managed:
            how = (
                "discovered from Kubernetes; it leaves with its pod (drain it to stop sending it requests)"
                if target.cfg.discovery is not None
                else "launched by the gateway; change the pool's engines and reload"
            )
            raise client_error(f"replica {r.name!r} is {how}", "replica_managed", status=409)
        self.fleet.unregister(target, r.name)
        who = self.who(request)
        self.audit.record(who, f"pool {target.name}: removed replica {r.name}")
        await self.state.publish_endpoint(target.name, r.url, None, who)
        return RemovedReplica(removed=r.name, inflight_requests=r.inflight_requests)

    async def drain(self, request: Request, pool: str, replica: str) -> ReplicaView:
        """Drain a replica: no new requests, those in flight finish"""
        return await self._set_draining(request, self._replica(pool, replica), True)

    async def undrain(self, request: Request, pool: str, replica: str) -> ReplicaView:
        """Undrain a replica: it takes new requests again"""
        return await self._set_draining(request, self._replica(pool, replica), False)

    async def _set_draining(self, request: Request, replica: Replica, draining: bool) -> ReplicaView:
        replica.draining = draining
        who = self.who(request)
        action = "drain" if draining else "undrain"
        self.audit.record(who, f"pool {replica.pool}: {action} replica {replica.name}")
        await self.state.publish_drain(replica.pool, replica.url, draining, who)
        return ReplicaView.of(replica)

    async def reload(self, request: Request) -> ReloadResult:
        who = self.who(request)
        try:
            result = await self.reloader.reload(who)
        except ReloadRejected as exc:
            log.warning("config reload by %s rejected: %s", who, exc)
            raise client_error(f"reload rejected: {exc}", "reload_rejected", status=409) from None
        return ReloadResult.model_validate(result)

    async def rollouts(self) -> RolloutsView:
        """Per route: its rules, and each variant (pool) once, with its weight and share in the
        split (the route's last rule, the one `PUT .../weights` changes by default) and its stats."""
        stats = self.variant_stats.snapshot()
        routes: dict[str, Any] = {}
        for model, rules in self.router.describe().items():
            split = {p["name"]: p["weight"] for p in rules[-1]["pools"]}
            total = sum(split.values())
            names = dict.fromkeys([*split, *(p["name"] for rule in rules for p in rule["pools"])])
            variants = {
                name: {
                    "weight": split.get(name),
                    "share": split[name] / total if name in split and total else None,
                    "stats": stats.get(model, {}).get(name),
                }
                for name in names
            }
            routes[model] = {"rules": rules, "split_rule": len(rules) - 1, "variants": variants}
        direct = {m: s for m, s in stats.items() if m not in routes}
        return RolloutsView.model_validate({"routes": routes, "direct": direct, "state": self.state.status()})

    async def audit_trail(self) -> AuditView:
        return AuditView.model_validate({"changes": list(self.audit.changes)})

    async def state_status(self) -> StateStatus:
        return StateStatus.model_validate(self.state.status())


# -- the admin key, the body bound, the error form ---------------------------------------------------
class AdminGuard:
    """Runs before routing, body parsing and validation: every request but the docs' must carry the
    admin key, and its body is read whole, up to MAX_BODY_BYTES (413 beyond), before the app sees
    it. Security headers go on every answer."""

    def __init__(self, app: ASGIApp, check_admin: AdminCheck) -> None:
        self.app = app
        self.check_admin = check_admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off and there are no websockets; nothing else comes
            return
        send = _with_headers(send)
        path: str = scope["path"]
        if scope["method"] in ("GET", "HEAD") and (
            path in (DOCS_URL, OPENAPI_URL) or path.startswith(DOCS_URL + "/")
        ):
            await self.app(scope, receive, send)
            return
        try:
            self.check_admin(Headers(scope=scope))
            body = await _read_body(scope, receive)
        except GatewayError as exc:
            await _error_response(exc)(scope, receive, send)
            return
        if body:
            scope = _as_json(scope)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


def _as_json(scope: Scope) -> Scope:
    """Every admin body is JSON: one sent without `Content-Type: application/json` (curl's `-d` says
    form-urlencoded) is read as JSON all the same, where FastAPI would take it for a string."""
    kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*kept, (b"content-type", b"application/json")]}


def _with_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *_SECURITY_HEADERS]
        await send(message)

    return sending


async def _read_body(scope: Scope, receive: Receive) -> bytes:
    too_large = client_error(f"request body exceeds {MAX_BODY_BYTES} bytes", "request_too_large", status=413)
    length = Headers(scope=scope).get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left
            raise client_error("client disconnected", "client_disconnected", status=499)
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing's 404 and 405, and FastAPI's 400 for a body it cannot parse."""
    assert isinstance(exc, HTTPException)
    code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(
        exc.status_code, "http_error"
    )
    message = f"{request.method} {clip(request.url.path)}: {exc.detail}"
    return Response(
        error_body(message, "invalid_request_error", code),
        exc.status_code,
        headers=exc.headers,
        media_type="application/json",
    )


async def _invalid_body(request: Request, exc: Exception) -> Response:
    """A body or path that fails its model: 400, `param` the field's path, `code` naming the field
    (`invalid_weights`, `invalid_url`...), `invalid_json` for a body that is not JSON."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    where = [str(p) for p in first["loc"][1:]]
    param = ".".join(where) or None
    if first["type"] == "json_invalid":
        code, param = "invalid_json", None
    elif first["type"] == "extra_forbidden":
        code = "unknown_field"
    else:
        code = f"invalid_{where[0]}" if where else f"invalid_{first['loc'][0]}"
    reason = first["msg"].removeprefix("Value error, ")  # a validator's own words
    message = f"{param or first['loc'][0]}: {reason}"
    return _error_response(client_error(clip(message, 500), code, param))


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises it after this answer, and uvicorn logs it with its traceback.
    return Response(
        error_body("internal gateway error", "server_error", "internal_error"),
        500,
        media_type="application/json",
    )


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the admin key as its (only) security scheme: enforced by AdminGuard,
    declared here so that the schema and the docs page's "Authorize" know it."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schema.setdefault("components", {})["securitySchemes"] = {
            "adminKey": {"type": "http", "scheme": "bearer", "description": "control.admin_key"}
        }
        schema["security"] = [{"adminKey": []}]
        app.openapi_schema = schema
    return app.openapi_schema
