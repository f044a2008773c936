"""The models clients can ask for, and where each request goes: pool, engine-side name, response name.

A client's `model` is looked up as a route alias first (routes[].model: a rule picks a pool, maybe one
of its LoRA adapters), then as a pool's model name, then as an adapter a pool serves (declared in the
config or learned from its replicas' `/v1/models`). Where several pools carry the name, the first (in
config order) whose `tasks` cover the endpoint wins. A known model asked for on an endpoint none of its
pools serves is a 400 that names what the pool does serve; an unknown model is a 404.

The list answers (`/v1/models`, `/v1/models/{id}`) are built here in vLLM's card layout (`id`,
`object`, `created`, `owned_by`, `root`, `parent`, `max_model_len`), without engine-side names: a route
alias shows as itself, an adapter without its path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError, model_not_found
from gateway.logs import clip
from gateway.prompt.endpoints import BY_NAME
from gateway.routing.pool_router import PoolRouter
from gateway.routing.rollout import Choice, Rollouts


@dataclass(slots=True)  # not frozen: a frozen dataclass is four times as slow to build
class Target:
    """Where one request goes."""

    router: PoolRouter  # the pool's router
    upstream: str  # the `model` the engines are sent
    adapter: str | None  # the LoRA adapter serving it (None: the base model)
    # The names an engine may answer with, to be replaced by the client's in the answer (empty:
    # nothing to do, or the route's `rewrite_model` is off).
    engine_names: tuple[str, ...]


class ModelCatalog:
    def __init__(self, routers: Mapping[str, PoolRouter], routes: Rollouts) -> None:
        """`routes` is the one rollout router (a config reload changes its rules in place)."""
        self.routers = routers
        self.routes = routes
        self.created = int(time.time())

    # -- resolution ---------------------------------------------------------------------------
    def resolve(
        self, model: str, endpoint: str | None, headers: Mapping[str, str], body: Mapping[str, Any]
    ) -> Target:
        """The target of a request for `model` on `endpoint` (None: any task, e.g. /tokenize)."""
        spec = BY_NAME.get(endpoint) if endpoint is not None else None
        wanted = spec.tasks if spec is not None else None
        if model in self.routes.routes:
            choice = self.routes.resolve(model, headers, body)
        else:
            choice = self._direct(model, wanted)
        if choice is None:
            raise model_not_found(model)
        router = self.routers[choice.pool]
        pool = router.pool
        if wanted is not None and wanted.isdisjoint(pool.cfg.tasks):
            raise GatewayError(
                400,
                f"the model `{clip(model)}` does not serve this endpoint ({endpoint}); it serves: "
                f"{', '.join(pool.cfg.tasks)}",
                "invalid_request_error",
                "unsupported_task",
                "model",
            )
        if choice.adapter is None:
            upstream = pool.upstream_model
        else:
            upstream = router.lora.upstream_name(choice.adapter)
        names: tuple[str, ...] = ()
        bases = router.lora.base_names
        # Nothing to rename (and no set built) when the engines get and give the client's name.
        if choice.rewrite_model and not (upstream == model == pool.upstream_model and not bases):
            # Whatever name the engine answers with: the one sent, the pool's, or an alias it listed.
            names = tuple(sorted({upstream, pool.upstream_model, *bases} - {model}))
        return Target(router, upstream, choice.adapter, names)

    def _direct(self, model: str, wanted: frozenset[str] | None) -> Choice | None:
        """A pool's own model name, else an adapter a pool serves: the first pool serving the task."""
        routers = self.routers.values()
        found = [r for r in routers if r.pool.model == model] or [r for r in routers if r.lora.knows(model)]
        if not found:
            return None
        fit = found[0]
        if wanted is not None and len(found) > 1:
            fit = next((r for r in found if not wanted.isdisjoint(r.pool.cfg.tasks)), fit)
        return Choice(fit.name, None if fit.pool.model == model else model)

    def only_model(self) -> str | None:
        """The one model served, when the gateway serves one and has no routes (vLLM's `model` is
        optional then, on the endpoints where it may be left out)."""
        names = {r.pool.model for r in self.routers.values()}
        return next(iter(names)) if len(names) == 1 and not self.routes.routes else None

    # -- listing ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every model id clients can ask for: routes, pools' models, adapters; each once."""
        return [card["id"] for card in self.cards()]

    def cards(self) -> list[dict[str, Any]]:
        cards: dict[str, dict[str, Any]] = {}
        for alias, rules in self.routes.routes.items():
            targets = [
                (self.routers[p], r.adapters.get(p)) for r in rules for p in r.pools if p in self.routers
            ]
            parents = {router.pool.model for router, adapter in targets if adapter is not None}
            lengths = [router.lora.max_model_len for router, _ in targets if router.lora.max_model_len]
            all_adapters = bool(targets) and all(adapter is not None for _, adapter in targets)
            parent = next(iter(parents)) if all_adapters and len(parents) == 1 else None
            cards.setdefault(alias, self._card(alias, parent, min(lengths) if lengths else None))
        for router in self.routers.values():
            model = router.pool.model
            cards.setdefault(model, self._card(model, None, router.lora.max_model_len))
        for router in self.routers.values():
            for adapter in router.lora.names():
                cards.setdefault(adapter, self._card(adapter, router.pool.model, None))
        return list(cards.values())

    def card(self, model: str) -> dict[str, Any] | None:
        return next((c for c in self.cards() if c["id"] == model), None)

    def _card(self, model: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        return {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "kvgate",
            "root": model,
            "parent": parent,
            "max_model_len": max_model_len,
        }
