"""The runtime admin API under /admin/: route weights, drain, endpoints, config reload, rollout stats.

Every call needs the admin key (`Authorization: Bearer <server.admin_key>`); without one set the
API answers 403. Every change is applied at once, logged with who made it, and kept in a short
audit trail (GET /admin/audit). A config reload swaps routes, weights and pool endpoints in
place without dropping a request, and refuses (naming the keys) anything that needs a restart.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from gateway.config import ConfigError, EndpointConfig, Settings, load_config
from gateway.errors import GatewayError
from gateway.logs import clip
from gateway.pool import Pool
from gateway.preflight import preflight
from gateway.replica import Replica
from gateway.request_body import parse_json_body
from gateway.rollout import Router
from gateway.runtime import Runtime

log = logging.getLogger(__name__)

AUDIT_SIZE = 200
Handler = Callable[[web.Request], Awaitable[web.Response]]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _bad(message: str, code: str, status: int = 400, param: str | None = None) -> GatewayError:
    return GatewayError(status, message, "invalid_request_error", code, param)


class ReloadRejected(Exception):
    """The new config changes something that cannot change while serving."""


def record_change(runtime: Runtime, who: str, what: str) -> None:
    log.info("admin change by %s: %s", who, what)
    runtime.audit.append({"at": time.time(), "who": who, "what": what})


# -- reload -------------------------------------------------------------------------------
def _live_differences(old: Settings, new: Settings) -> list[str]:
    """Keys whose change needs a restart (everything but routes and unmanaged pool endpoints)."""
    problems = []
    for key in Settings.model_fields:
        if key in ("routes", "pools") or getattr(old, key) == getattr(new, key):
            continue
        a, b = old.model_dump()[key], new.model_dump()[key]
        if isinstance(a, dict) and isinstance(b, dict):
            problems += [f"{key}.{k}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
        else:
            problems.append(key)
    old_pools = {p.name: p for p in old.pools}
    new_pools = {p.name: p for p in new.pools}
    if old_pools.keys() != new_pools.keys():
        problems.append(f"pools (names {sorted(old_pools)} -> {sorted(new_pools)})")
    for name in old_pools.keys() & new_pools.keys():
        a = old_pools[name].model_dump(exclude={"endpoints"})
        b = new_pools[name].model_dump(exclude={"endpoints"})
        problems += [f"pools.{name}.{k}" for k in a if a[k] != b[k]]
    return problems


def apply_settings(runtime: Runtime, new: Settings, who: str) -> dict[str, Any]:
    """Swap routes, weights and unmanaged endpoints to `new`, in place and at once.

    Raises ReloadRejected (nothing changed) when `new` differs in anything else.
    """
    problems = _live_differences(runtime.settings, new)
    if problems:
        raise ReloadRejected(f"these cannot change without a restart: {', '.join(problems)}")
    try:
        router = Router(new.routes, {p.name: p.model for p in runtime.pools.values()})
    except ValueError as exc:
        raise ReloadRejected(f"routes: {exc}") from None
    plan: list[tuple[str, list[str], list[EndpointConfig]]] = []
    for pcfg in new.pools:
        pool = runtime.pools[pcfg.name]
        wanted = {ep.url: ep for ep in pcfg.endpoints}
        current = {r.url: r for r in pool.replicas.values() if not r.managed}
        remove = [
            r.name
            for url, r in current.items()
            if url not in wanted or (wanted[url].role, wanted[url].kind) != (r.role, r.kind)
        ]
        add = [ep for url, ep in wanted.items() if url not in current or current[url].name in remove]
        kept = set(pool.replicas) - set(remove)
        clash = [ep.name for ep in add if ep.name is not None and ep.name in kept]
        if clash:
            raise ReloadRejected(f"pools.{pcfg.name}.endpoints: names {clash} are used by other replicas")
        plan.append((pcfg.name, remove, add))
    # No await from here on: requests see either the old state or the new one.
    changes: list[str] = []
    for name, remove, add in plan:
        pool = runtime.pools[name]
        for rname in remove:
            runtime.unregister(pool, rname)
            changes.append(f"pool {name}: removed replica {rname}")
        for ep in add:
            r = runtime.add_endpoint(pool, ep)
            changes.append(f"pool {name}: added replica {r.name} at {r.url}")
        pool.cfg = new.pool(name)
    if router.describe() != runtime.router.describe():
        changes.append("routes replaced")
    runtime.router = router
    runtime.settings = new
    record_change(runtime, who, "config reloaded: " + ("; ".join(changes) or "no changes"))
    return {"changes": changes}


async def reload_config(runtime: Runtime, who: str) -> dict[str, Any]:
    """Re-read the config file the gateway was started with and apply it (SIGHUP and the API)."""
    if runtime.config_path is None:
        raise ReloadRejected("the gateway was not started from a config file")
    try:
        new = load_config(runtime.config_path)
        preflight(new)
    except ConfigError as exc:
        raise ReloadRejected(f"invalid config: {exc}") from None
    if runtime.server_overrides:  # what the command line set wins over the file, as at start
        new = new.model_copy(update={"server": new.server.model_copy(update=runtime.server_overrides)})
    result = apply_settings(runtime, new, who)
    await runtime.state.publish_routes(who)
    return result


# -- handlers -----------------------------------------------------------------------------
class Admin:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def who(self, request: web.Request) -> str:
        # The admin key is one shared secret: name it by a fingerprint, never by the key itself.
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        key_id = hashlib.sha256(token.encode()).hexdigest()[:8]
        return f"admin key {key_id} from {request.remote}"

    def _pool(self, request: web.Request) -> Pool:
        name = request.match_info["pool"]
        pool = self.rt.pools.get(name)
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
        return parse_json_body(await request.read(), self.rt.settings.server.max_json_depth)

    async def routes(self, request: web.Request) -> web.Response:
        return _json({"routes": self.rt.router.describe()})

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
        router = self.rt.router
        try:
            before = router.weights(model, rule)
            index = router.set_weights(model, weights, rule)
        except KeyError as exc:
            raise _bad(str(exc.args[0]), "route_not_found", 404) from None
        except ValueError as exc:
            raise _bad(str(exc), "invalid_weights", param="weights") from None
        after = router.weights(model, index)
        who = self.who(request)
        record_change(self.rt, who, f"route {model} rule {index} weights {before} -> {after}")
        await self.rt.state.publish_weights(model, index, after, who)
        return _json({"model": model, "rule": index, "weights": after, "previous": before})

    async def pools(self, request: web.Request) -> web.Response:
        return _json(
            {
                "pools": {
                    name: {
                        "model": pool.model,
                        "replicas": {r.name: _replica_view(r) for r in pool.replicas.values()},
                    }
                    for name, pool in self.rt.pools.items()
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
            replica = self.rt.add_endpoint(pool, ep)
        except ValueError as exc:
            raise _bad(str(exc), "replica_exists", 409) from None
        who = self.who(request)
        record_change(self.rt, who, f"pool {pool.name}: added replica {replica.name} at {replica.url}")
        await self.rt.state.publish_endpoint(pool.name, ep.url, ep.model_dump(), who)
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
        self.rt.unregister(pool, replica.name)
        who = self.who(request)
        record_change(self.rt, who, f"pool {pool.name}: removed replica {replica.name}")
        await self.rt.state.publish_endpoint(pool.name, replica.url, None, who)
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
        record_change(self.rt, who, f"pool {replica.pool}: {action} replica {replica.name}")
        await self.rt.state.publish_drain(replica.pool, replica.url, draining, who)
        return _json(_replica_view(replica))

    async def reload(self, request: web.Request) -> web.Response:
        try:
            result = await reload_config(self.rt, self.who(request))
        except ReloadRejected as exc:
            log.warning("config reload by %s rejected: %s", self.who(request), exc)
            raise _bad(f"reload rejected: {exc}", "reload_rejected", 409) from None
        return _json(result)

    async def rollouts(self, request: web.Request) -> web.Response:
        """Per route: its rules, and each variant (pool) once, with its weight and share in the
        split (the route's last rule, the one `PUT .../weights` changes by default) and its stats."""
        stats = self.rt.variant_stats.snapshot()
        routes: dict[str, Any] = {}
        for model, rules in self.rt.router.describe().items():
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
        return _json({"routes": routes, "direct": direct, "state": self.rt.state.status()})

    async def audit(self, request: web.Request) -> web.Response:
        return _json({"changes": list(self.rt.audit)})

    async def state(self, request: web.Request) -> web.Response:
        return _json(self.rt.state.status())


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


def register_admin(app: web.Application, runtime: Runtime) -> None:
    """Add the /admin/ routes, each behind the admin key."""
    admin = Admin(runtime)

    def guarded(handler: Handler) -> Handler:
        async def checked(request: web.Request) -> web.Response:
            runtime.auth.admin(request.headers)
            return await handler(request)

        return checked

    r = app.router
    r.add_get("/admin/routes", guarded(admin.routes))
    r.add_put("/admin/routes/{model:.+}/weights", guarded(admin.set_weights))
    r.add_get("/admin/rollouts", guarded(admin.rollouts))
    r.add_get("/admin/pools", guarded(admin.pools))
    r.add_post("/admin/pools/{pool}/replicas", guarded(admin.add_replica))
    r.add_delete("/admin/pools/{pool}/replicas/{replica}", guarded(admin.remove_replica))
    r.add_post("/admin/pools/{pool}/replicas/{replica}/drain", guarded(admin.drain))
    r.add_post("/admin/pools/{pool}/replicas/{replica}/undrain", guarded(admin.undrain))
    r.add_post("/admin/reload", guarded(admin.reload))
    r.add_get("/admin/audit", guarded(admin.audit))
    r.add_get("/admin/state", guarded(admin.state))
