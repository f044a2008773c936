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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from gateway.logs import clip
from gateway.model_names import ModelRename
from gateway.pool import Pool
from gateway.rollout import Choice, Router

# Which pool tasks can answer each endpoint (vLLM registers routes the same way: embeddings for
# `embed`, classify for `classify`, score and rerank for `score` or `embed`, pooling for any of them).
ENDPOINT_TASKS: dict[str, frozenset[str]] = {
    "chat": frozenset({"generate"}),
    "completions": frozenset({"generate"}),
    "responses": frozenset({"generate"}),
    "embeddings": frozenset({"embed"}),
    "pooling": frozenset({"embed", "classify", "score"}),
    "classify": frozenset({"classify"}),
    "score": frozenset({"score", "embed"}),
    "rerank": frozenset({"score", "embed"}),
}
_RENAMES_KEPT = 1024


@dataclass(frozen=True, slots=True)
class Target:
    """Where one request goes."""

    pool: Pool
    upstream: str  # the `model` the engines are sent
    adapter: str | None  # the LoRA adapter serving it (None: the base model)
    rename: ModelRename | None  # puts the client's name back in the answer (None: nothing to do)


class ModelCatalog:
    def __init__(self, pools: Mapping[str, Pool], router: Callable[[], Router]) -> None:
        """`router` returns the current router (a config reload replaces it)."""
        self.pools = pools
        self._router = router
        self.created = int(time.time())
        self._renames: dict[tuple[tuple[str, ...], str], ModelRename] = {}

    # -- resolution ---------------------------------------------------------------------------
    def resolve(
        self, model: str, endpoint: str | None, headers: Mapping[str, str], body: Mapping[str, Any]
    ) -> Target:
        """The target of a request for `model` on `endpoint` (None: any task, e.g. /tokenize)."""
        router = self._router()
        wanted = ENDPOINT_TASKS.get(endpoint) if endpoint is not None else None
        if model in router.routes:
            choice = router.resolve(model, headers, body)
        else:
            choice = self._direct(model, wanted)
        if choice is None:
            raise GatewayError(
                404,
                f"the model `{clip(model)}` does not exist",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        pool = self.pools[choice.pool]
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
            upstream = pool.lora.upstream_name(choice.adapter)
        rename = self._rename(pool, upstream, model) if choice.rewrite_model else None
        return Target(pool, upstream, choice.adapter, rename)

    def _direct(self, model: str, wanted: frozenset[str] | None) -> Choice | None:
        """A pool's own model name, else an adapter a pool serves: the first pool serving the task."""
        for serves in (lambda p: p.model == model, lambda p: p.lora.knows(model)):
            found = [p for p in self.pools.values() if serves(p)]
            if found:
                fit = next(
                    (p for p in found if wanted is None or not wanted.isdisjoint(p.cfg.tasks)), found[0]
                )
                return Choice(fit.name, None if fit.model == model else model)
        return None

    def _rename(self, pool: Pool, upstream: str, client: str) -> ModelRename | None:
        # Whatever name the engine answers with: the one sent, the pool's, or an alias it listed.
        names = tuple(sorted({upstream, pool.upstream_model, *pool.lora.base_names} - {client}))
        if not names:
            return None
        key = (names, client)
        rename = self._renames.get(key)
        if rename is None:
            if len(self._renames) >= _RENAMES_KEPT:
                self._renames.clear()
            rename = self._renames[key] = ModelRename(names, client)
        return rename

    # -- listing ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every model id clients can ask for: routes, pools' models, adapters; each once."""
        return [card["id"] for card in self.cards()]

    def cards(self) -> list[dict[str, Any]]:
        cards: dict[str, dict[str, Any]] = {}
        router = self._router()
        for alias, rules in router.routes.items():
            targets = [(self.pools[p], r.adapters.get(p)) for r in rules for p in r.pools if p in self.pools]
            parents = {pool.model for pool, adapter in targets if adapter is not None}
            lengths = [pool.lora.max_model_len for pool, _ in targets if pool.lora.max_model_len]
            all_adapters = bool(targets) and all(adapter is not None for _, adapter in targets)
            parent = next(iter(parents)) if all_adapters and len(parents) == 1 else None
            cards.setdefault(alias, self._card(alias, parent, min(lengths) if lengths else None))
        for pool in self.pools.values():
            cards.setdefault(pool.model, self._card(pool.model, None, pool.lora.max_model_len))
        for pool in self.pools.values():
            for adapter in pool.lora.names():
                cards.setdefault(adapter, self._card(adapter, pool.model, None))
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
