"""The status page: `/dashboard` (one self-contained HTML file) and its live data, `/dashboard/state`.

The state is read from the gateway's objects (a `GatewayView`) when asked: pools, replicas (health,
circuit, own and engine-reported load), estimated prefix-hit rate, admission queue depth and
rollout weights.
It holds no secrets (no keys, no tenant names, no replica URLs) and no prompt text. When
`control.admin_key` is set, `/dashboard/state` requires it as `Authorization: Bearer <key>`;
the page itself is a static shell holding no data, takes the key once as `?key=`, keeps it
in the tab's sessionStorage and removes it from the address bar.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from importlib import metadata, resources
from typing import TYPE_CHECKING, Any

from gateway.observe.metrics import GatewayMetrics, PoolTraffic, ReplicaTraffic, queued_by_class
from gateway.observe.view import GatewayView
from gateway.path.exchange import Exchange, Reply, Route, json_reply

if TYPE_CHECKING:
    from gateway.fleet.pool import Pool
    from gateway.fleet.replica import Replica
    from gateway.routing.precise_prefix import PrecisePrefix

# The page runs only its own inline code and talks only to this origin.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",  # the first load may carry ?key=
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def _version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "dev"


class Dashboard:
    def __init__(
        self,
        view: GatewayView,
        metrics: GatewayMetrics | None,
        tracing: bool,
        check_admin: Callable[[Mapping[str, str]], None] | None,
    ) -> None:
        """`metrics`: traffic totals (unknown when metrics are off); `check_admin`: the admin key
        check that guards the live data, None when no admin key is set."""
        self.view = view
        self.metrics = metrics
        self.tracing = tracing
        self.check_admin = check_admin
        self.started = time.monotonic()
        self.version = _version()
        self.page_html = resources.files("gateway").joinpath("static/dashboard.html").read_bytes()

    def routes(self) -> list[Route]:
        return [Route("GET", "/dashboard", self.page), Route("GET", "/dashboard/state", self.state_endpoint)]

    async def page(self, request: Exchange) -> Reply:
        return Reply(200, self.page_html, {"Content-Type": "text/html", **_PAGE_HEADERS})

    async def state_endpoint(self, request: Exchange) -> Reply:
        if self.check_admin is not None:
            self.check_admin(request.headers)
        return json_reply(self.state(), headers={"Cache-Control": "no-store"})

    # -- the data ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        view = self.view
        sched = view.scheduler_stats()
        pools = [self._pool(p, queued_by_class(sched, p.name)) for p in view.pools.values()]
        replicas = [r for p in pools for r in p["replicas"]]
        return {
            "gateway": {
                "version": self.version,
                "uptime_s": round(time.monotonic() - self.started, 1),
                "draining": view.draining(),
                "metrics": self.metrics is not None,
                "tracing": self.tracing,
            },
            "totals": {
                "pools": len(pools),
                "replicas": len(replicas),
                "healthy": sum(r["healthy"] for r in replicas),
                "available": sum(r["available"] for r in replicas),
                "inflight": sum(r["inflight_requests"] for r in replicas),
                "queued": sum(p["queue_depth"] for p in pools),
                "requests": sum(p["requests"] or 0 for p in pools),
            },
            "pools": pools,
            "routes": self._routes(),
        }

    def _pool(self, pool: Pool, queued: dict[str, int]) -> dict[str, Any]:
        metrics = self.metrics
        precise = self.view.routers[pool.name].precise
        # Traffic totals come from the metrics observer: unknown (None) when metrics are off.
        traffic = None if metrics is None else metrics.traffic.get(pool.name, PoolTraffic())
        return {
            "name": pool.name,
            "model": pool.model,
            "policy": pool.cfg.policy.type,
            "queued": queued,
            "queue_depth": sum(queued.values()),
            # Token totals let the page compute a recent hit rate from two polls.
            "requests": traffic and traffic.requests,
            "errors": traffic and traffic.errors,
            "prompt_tokens": traffic and traffic.prompt_tokens,
            "matched_tokens": traffic and traffic.matched_tokens,
            "hit_ratio": traffic and traffic.hit_ratio,
            "replicas": [self._replica(r, precise) for r in pool.replicas.values()],
        }

    def _replica(self, r: Replica, precise: PrecisePrefix | None) -> dict[str, Any]:
        eng = r.engine
        metrics = self.metrics
        tokens = None if metrics is None else metrics.replica_traffic.get((r.pool, r.name), ReplicaTraffic())
        return {
            "name": r.name,
            "role": r.role,
            "kind": r.kind,
            "healthy": r.healthy,
            "available": r.available,
            "draining": r.draining,
            "circuit": r.circuit.value,
            "inflight_requests": r.inflight_requests,
            "inflight_tokens": r.inflight_tokens,
            "total_requests": self.view.routed.of(r),
            # Tokens routed to it and those believed held there by medium (kvgate's index), beside
            # what its engine counted (None where it does not say): the tier figures, side by side.
            "prefix": {
                "routed_tokens": tokens and tokens.prompt_tokens,
                "gpu_matched_tokens": tokens and tokens.matched_tokens,
                "cpu_matched_tokens": tokens and tokens.cpu_matched_tokens,
                "engine_gpu_hit_tokens": eng.gpu_hit_tokens_total,
                "engine_cpu_hit_tokens": eng.cpu_hit_tokens_total,
                "engine_cpu_loads": eng.cpu_loads_total,
            },
            "engine": {
                "fresh": r.engine_fresh,
                "age_s": round(time.monotonic() - eng.updated_at, 2) if eng.updated_at else None,
                "waiting": eng.waiting,
                "running": eng.running,
                "kv_usage": eng.kv_usage,
            },
            "kv_events": _kv_events(r, precise),
        }

    def _routes(self) -> list[dict[str, Any]]:
        out = []
        for model, rules in self.view.routes.routes.items():
            described = []
            for rule in rules:
                total = sum(rule.weights)
                described.append(
                    {
                        # Header names only: a match value could be something an operator keeps private.
                        "match_headers": sorted(rule.headers),
                        "sticky": rule.sticky_sources is not None,
                        "pools": [
                            {"name": name, "weight": w, "share": w / total if total else 0.0}
                            for name, w in zip(rule.pools, rule.weights, strict=True)
                        ],
                    }
                )
            out.append({"model": model, "rules": described})
        return out


def _kv_events(r: Replica, precise: PrecisePrefix | None) -> dict[str, Any] | None:
    """Precise mode: the replica's KV event stream (None when the pool is not in precise mode or the
    replica has no publisher). `missing` means it is routed by the approximate index."""
    sub = precise.subscribers.get(r.name) if precise is not None else None
    if precise is None or sub is None:
        return None
    now = time.monotonic()
    last = sub.stats.last_event_at
    return {
        "state": precise.events_state(r.name, now),
        "age_s": round(now - last, 2) if last is not None else None,
        "batches": sub.stats.batches,
        "fallback_decisions": precise.fallback_decisions.get(r.name, 0),
    }
