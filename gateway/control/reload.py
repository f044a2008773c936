"""Config reload: re-read the config file the gateway started from and apply, in place and at
once, what may change while serving (routes, their weights, unmanaged pool endpoints); refuse,
naming the keys, anything that needs a restart. The admin API and SIGHUP both come here.

The file wins only where it changed: a route whose definition in the file is the same as at the
last load keeps the weights in force (set at run time by the admin API or the shared state), and a
pool whose `endpoints` are the same keeps its replicas as they are (added or removed at run time).
A route that changed takes the file's weights, and the answer names each weight that moved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import ConfigError, EndpointConfig, Settings, load_config
from gateway.control.audit import AuditTrail
from gateway.control.preflight import preflight
from gateway.control.state import StateBackend
from gateway.fleet.fleet import Fleet
from gateway.routing.rollout import Rollouts


class ReloadRejected(Exception):
    """The new config changes something that cannot change while serving."""


def live_differences(old: Settings, new: Settings) -> list[str]:
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


def _fmt(weight: float | None) -> str:
    return "none" if weight is None else f"{weight:g}"


def carry_weights(old: Settings, new: Settings, live: Rollouts, fresh: Rollouts) -> list[str]:
    """Give `fresh` (built from `new`) the weights in force in `live` for every route the file did
    not change; for each route it did change, one line per weight that moves, saying whether the
    weight it replaces had been set at run time."""
    before = {r.model: r for r in old.routes}
    lines = []
    for route in new.routes:
        model, rules, now = route.model, fresh.routes[route.model], live.routes.get(route.model, [])
        if before.get(model) == route:
            for rule, kept in zip(rules, now, strict=True):
                rule.weights = list(kept.weights)
            continue
        if not now:
            continue  # a new route: no weight was in force
        in_file = [[p.weight for p in r.pools] for r in before[model].rules] if model in before else []
        for i, rule in enumerate(rules):
            was = dict(zip(now[i].pools, now[i].weights, strict=True)) if i < len(now) else {}
            at_run_time = i < min(len(now), len(in_file)) and now[i].weights != in_file[i]
            after = dict(zip(rule.pools, rule.weights, strict=True))
            for pool in [*was, *(p for p in after if p not in was)]:
                if was.get(pool) != after.get(pool):
                    note = " (set at run time)" if at_run_time and pool in was else ""
                    lines.append(
                        f"route {model} rule {i}: {pool} weight {_fmt(was.get(pool))}{note}"
                        f" -> {_fmt(after.get(pool))} (the file's)"
                    )
    return lines


class Reloader:
    """Holds the settings in force and where they came from (`config_path`, and the command
    line's `server.*` values, which win over the file as they did at start)."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        router: Rollouts,
        state: StateBackend,
        audit: AuditTrail,
        config_path: str | None = None,
        server_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.router = router
        self.state = state
        self.audit = audit
        self.config_path = config_path
        self.server_overrides = dict(server_overrides or {})

    def apply(self, new: Settings, who: str) -> dict[str, Any]:
        """Swap routes, weights and unmanaged endpoints to `new`, in place and at once.

        Raises ReloadRejected (nothing changed) when `new` differs in anything else.
        """
        problems = live_differences(self.settings, new)
        if problems:
            raise ReloadRejected(f"these cannot change without a restart: {', '.join(problems)}")
        pools = self.fleet.pools
        try:
            router = Rollouts(new.routes, {p.name: p.model for p in pools.values()})
        except ValueError as exc:
            raise ReloadRejected(f"routes: {exc}") from None
        weight_changes = carry_weights(self.settings, new, self.router, router)
        plan: list[tuple[str, list[str], list[EndpointConfig]]] = []
        for pcfg in new.pools:
            if pcfg.endpoints == self.settings.pool(pcfg.name).endpoints:
                continue  # unchanged in the file: replicas added or removed at run time stay so
            pool = pools[pcfg.name]
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
            pool = pools[name]
            for rname in remove:
                self.fleet.unregister(pool, rname)
                changes.append(f"pool {name}: removed replica {rname}")
            for ep in add:
                r = self.fleet.add_endpoint(pool, ep)
                changes.append(f"pool {name}: added replica {r.name} at {r.url}")
        for pcfg in new.pools:
            pools[pcfg.name].cfg = pcfg
        if router.describe() != self.router.describe():
            changes.append("routes replaced")
            changes += weight_changes
        # The one Rollouts everyone holds takes the new rules (pools, and so direct models, are unchanged).
        self.router.routes = router.routes
        self.settings = new
        self.audit.record(who, "config reloaded: " + ("; ".join(changes) or "no changes"))
        return {"changes": changes}

    async def reload(self, who: str) -> dict[str, Any]:
        """Re-read the config file the gateway was started with and apply it."""
        if self.config_path is None:
            raise ReloadRejected("the gateway was not started from a config file")
        try:
            new = load_config(self.config_path)
            preflight(new)
        except ConfigError as exc:
            raise ReloadRejected(f"invalid config: {exc}") from None
        if self.server_overrides:  # what the command line set wins over the file, as at start
            new = new.model_copy(update={"server": new.server.model_copy(update=self.server_overrides)})
        result = self.apply(new, who)
        await self.state.publish_routes(who)
        return result
