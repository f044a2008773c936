"""The runtime admin API under /admin/: route weights, drain, endpoints, config reload, rollout stats.

Every call needs the admin key (`Authorization: Bearer <server.admin_key>`); without one set the
API answers 403. Every change is applied at once, logged with who made it, and kept in a short
audit trail (GET /admin/audit). A config reload (gateway.control.reload) swaps routes, weights and
pool endpoints in place without dropping a request, and refuses (naming the keys) anything that
needs a restart.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from gateway.config import EndpointConfig
from gateway.control.audit import AuditTrail
from gateway.control.reload import Reloader, ReloadRejected
from gateway.control.state import StateBackend
from gateway.control.variant_stats import VariantStats
from gateway.errors import GatewayError
from gateway.fleet.fleet import Fleet
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.logs import clip
from gateway.path.request import parse_json_body
from gateway.routing.rollout import Router

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.Response]]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _bad(message: str, code: str, status: int = 400, param: str | None = None) -> GatewayError:
    return GatewayError(status, message, "invalid_request_error", code, param)


# -- handlers -----------------------------------------------------------------------------
class Admin:
    def __init__(
        self,
        fleet: Fleet,
        router: Router,
        state: StateBackend,
        reloader: Reloader,
        audit: AuditTrail,
        variant_stats: VariantStats,
        max_json_depth: int,
    ) -> None:
        self.fleet = fleet
        self.router = router
        self.state = state
        self.reloader = reloader
        self.audit = audit
        self.variant_stats = variant_stats
        self.max_json_depth = max_json_depth

    def route_defs(self, check_admin: Callable[[Mapping[str, str]], None]) -> list[web.RouteDef]:
        """The /admin/ routes, each behind `check_admin` (the admin key check)."""

        def guarded(handler: Handler) -> Handler:
            async def checked(request: web.Request) -> web.Response:
                check_admin(request.headers)
                return await handler(request)

            return checked

        return [
            web.get("/admin/routes", guarded(self.routes)),
            web.put("/admin/routes/{model:.+}/weights", guarded(self.set_weights)),
            web.get("/admin/rollouts", guarded(self.rollouts)),
            web.get("/admin/pools", guarded(self.pools)),
            web.post("/admin/pools/{pool}/replicas", guarded(self.add_replica)),
            web.delete("/admin/pools/{pool}/replicas/{replica}", guarded(self.remove_replica)),
            web.post("/admin/pools/{pool}/replicas/{replica}/drain", guarded(self.drain)),
            web.post("/admin/pools/{pool}/replicas/{replica}/undrain", guarded(self.undrain)),
            web.post("/admin/reload", guarded(self.reload)),
            web.get("/admin/audit", guarded(self.audit_trail)),
            web.get("/admin/state", guarded(self.state_status)),
        ]

    def who(self, request: web.Request) -> str:
        # The admin key is one shared secret: name it by a fingerprint, never by the key itself.
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        key_id = hashlib.sha256(token.encode()).hexdigest()[:8]
        return f"admin key {key_id} from {request.remote}"

    def _pool(self, request: web.Request) -> Pool:
        name = request.match_info["pool"]
        pool = self.fleet.pools.get(name)
        if pool is None:
            raise _bad(f"no pool {clip(name, 64)!r}", "pool_not_found", 404)
        return pool

    def _replica(self, request: web.Request) -> Replica:
        pool = self._pool(request)
        name = request.match_info["replica"]
        replica = pool.replicas.get(name)
        if replica is None:
            raise _bad(f"pool {pool.name!r} has no replica {clip(name, 64)!r}", "replica_not_found", 404)
        return replica

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return parse_json_body(await request.read(), self.max_json_depth)

    async def routes(self, request: web.Request) -> web.Response:
        return _json({"routes": self.router.describe()})

    async def set_weights(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        body = await self._body(request)
        weights = body.get("weights")
        rule = body.get("rule")
        if not isinstance(weights, dict) or not weights:
            raise _bad("body needs `weights`: {pool: weight, ...}", "invalid_weights", param="weights")
        if not all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights.values()):
            raise _bad("weights must be numbers", "invalid_weights", param="weights")
        if rule is not None and not isinstance(rule, int):
            raise _bad("`rule` must be an integer index", "invalid_rule", param="rule")
        router = self.router
        try:
            before = router.weights(model, rule)
            index = router.set_weights(model, weights, rule)
        except KeyError as exc:
            raise _bad(str(exc.args[0]), "route_not_found", 404) from None
        except ValueError as exc:
            raise _bad(str(exc), "invalid_weights", param="weights") from None
        after = router.weights(model, index)
        who = self.who(request)
        self.audit.record(who, f"route {model} rule {index} weights {before} -> {after}")
        await self.state.publish_weights(model, index, after, who)
        return _json({"model": model, "rule": index, "weights": after, "previous": before})

    async def pools(self, request: web.Request) -> web.Response:
        return _json(
            {
                "pools": {
                    name: {
                        "model": pool.model,
                        "replicas": {r.name: _replica_view(r) for r in pool.replicas.values()},
                    }
                    for name, pool in self.fleet.pools.items()
                }
            }
        )

    async def add_replica(self, request: web.Request) -> web.Response:
        pool = self._pool(request)
        body = await self._body(request)
        try:
            ep = EndpointConfig(**body)
        except ValueError as exc:
            raise _bad(f"invalid endpoint: {exc}", "invalid_endpoint") from None
        if any(r.url == ep.url for r in pool.replicas.values()):
            raise _bad(f"pool {pool.name!r} already has {ep.url}", "replica_exists", 409)
        try:
            replica = self.fleet.add_endpoint(pool, ep)
        except ValueError as exc:
            raise _bad(str(exc), "replica_exists", 409) from None
        who = self.who(request)
        self.audit.record(who, f"pool {pool.name}: added replica {replica.name} at {replica.url}")
        await self.state.publish_endpoint(pool.name, ep.url, ep.model_dump(), who)
        return _json(_replica_view(replica), status=201)

    async def remove_replica(self, request: web.Request) -> web.Response:
        pool = self._pool(request)
        replica = self._replica(request)
        if replica.managed:
            how = (
                "discovered from Kubernetes; it leaves with its pod (drain it to stop sending it requests)"
                if pool.cfg.discovery is not None
                else "launched by the gateway; change the pool's engines and reload"
            )
            raise _bad(f"replica {replica.name!r} is {how}", "replica_managed", 409)
        self.fleet.unregister(pool, replica.name)
        who = self.who(request)
        self.audit.record(who, f"pool {pool.name}: removed replica {replica.name}")
        await self.state.publish_endpoint(pool.name, replica.url, None, who)
        return _json({"removed": replica.name, "inflight_requests": replica.inflight_requests})

    async def drain(self, request: web.Request) -> web.Response:
        return await self._set_draining(request, True)

    async def undrain(self, request: web.Request) -> web.Response:
        return await self._set_draining(request, False)

    async def _set_draining(self, request: web.Request, draining: bool) -> web.Response:
        replica = self._replica(request)
        replica.draining = draining
        who = self.who(request)
        action = "drain" if draining else "undrain"
        self.audit.record(who, f"pool {replica.pool}: {action} replica {replica.name}")
        await self.state.publish_drain(replica.pool, replica.url, draining, who)
        return _json(_replica_view(replica))

    async def reload(self, request: web.Request) -> web.Response:
        try:
            result = await self.reloader.reload(self.who(request))
        except ReloadRejected as exc:
            log.warning("config reload by %s rejected: %s", self.who(request), exc)
            raise _bad(f"reload rejected: {exc}", "reload_rejected", 409) from None
        return _json(result)

    async def rollouts(self, request: web.Request) -> web.Response:
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
        return _json({"routes": routes, "direct": direct, "state": self.state.status()})

    async def audit_trail(self, request: web.Request) -> web.Response:
        return _json({"changes": list(self.audit.changes)})

    async def state_status(self, request: web.Request) -> web.Response:
        return _json(self.state.status())


def _replica_view(r: Replica) -> dict[str, Any]:
    return {
        "name": r.name,
        "url": r.url,
        "role": r.role,
        "kind": r.kind,
        "managed": r.managed,
        "healthy": r.healthy,
        "draining": r.draining,
        "available": r.available,
        "circuit": str(r.circuit),
        "inflight_requests": r.inflight_requests,
        "inflight_tokens": r.inflight_tokens,
        "remote_inflight_requests": r.remote_inflight_requests,
        "remote_inflight_tokens": r.remote_inflight_tokens,
        "total_requests": r.total_requests,
    }
