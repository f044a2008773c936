"""Model aliases -> pools: header-matched rules, weighted splits and sticky assignment.

A client asks for a model name; the first rule of that name's route whose header match
holds picks the pool. A weighted rule assigns a request by `xxh64(salt + key) mod 10000`
against the cumulative weights, so a key always lands in the same place for given weights
and raising a canary's weight only moves keys from the other pools to it. A request without
a sticky key is assigned at random by weight. Keys come from a header (a user or session id) or a
body field (`user`, or a dotted path like `metadata.session_id`). A pool's own model name
always routes to it. A rule's pool may be served with one of its LoRA adapters (`adapter`).
Weights change at runtime (`set_weights`, the admin API, the shared state backend); a
weight of 0 takes a pool out of its rule at once (rollback).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from gateway.config import RouteConfig, RouteRule

BUCKETS = 10_000
STICKY_KINDS = ("header", "body")


@dataclass(slots=True)  # not frozen: a frozen dataclass is four times as slow to build
class Choice:
    """Where a request for a model goes: a pool, maybe one of its adapters, and whether responses
    name the model as the client asked for it."""

    pool: str
    adapter: str | None = None
    rewrite_model: bool = True


@dataclass(slots=True)
class Rule:
    headers: dict[str, str]
    pools: list[str]
    weights: list[float]
    sticky_sources: list[tuple[str, str]] | None
    salt: str
    sticky_spec: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # pool -> the adapter serving the route there
    rewrite_model: bool = True  # the route's `rewrite_model`, on each rule so a reload swaps both at once

    @classmethod
    def from_config(cls, rule: RouteRule, rewrite_model: bool = True) -> Rule:
        sources = None
        if rule.sticky is not None:
            sources = []
            for part in rule.sticky.key.split("|"):
                kind, _, name = part.strip().partition(":")
                if kind not in STICKY_KINDS or not name:
                    raise ValueError(f"sticky key source {part!r}: expected header:NAME or body:FIELD")
                sources.append((kind, name.lower() if kind == "header" else name))
        return cls(
            headers={k.lower(): v for k, v in (rule.match.headers if rule.match else {}).items()},
            pools=[p.name for p in rule.pools],
            weights=[p.weight for p in rule.pools],
            sticky_sources=sources,
            salt=rule.sticky.salt if rule.sticky else "",
            sticky_spec=rule.sticky.key if rule.sticky else None,
            adapters={p.name: p.adapter for p in rule.pools if p.adapter is not None},
            rewrite_model=rewrite_model,
        )

    def matches(self, headers: Mapping[str, str]) -> bool:
        return all(headers.get(k) == v for k, v in self.headers.items())

    def sticky_key(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        for kind, name in self.sticky_sources or ():
            value = headers.get(name) if kind == "header" else _body_field(body, name)
            if value and isinstance(value, str | int):
                return str(value)
        return None

    def pick(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        total = sum(self.weights)
        if total <= 0:
            return None
        key = self.sticky_key(headers, body) if self.sticky_sources else None
        if key is None:
            point = random.random() * total
        else:
            point = sticky_bucket(self.salt, key) / BUCKETS * total
        acc = 0.0
        for name, weight in zip(self.pools, self.weights, strict=True):
            acc += weight
            if point < acc:
                return name
        # Only float rounding at the very top gets here: it belongs to the last pool with weight.
        return next(n for n, w in zip(reversed(self.pools), reversed(self.weights), strict=True) if w > 0)

    def describe(self) -> dict[str, Any]:
        return {
            "match": {"headers": self.headers} if self.headers else None,
            "pools": [
                {"name": n, "weight": w, **({"adapter": self.adapters[n]} if n in self.adapters else {})}
                for n, w in zip(self.pools, self.weights, strict=True)
            ],
            "sticky": {"key": self.sticky_spec, "salt": self.salt} if self.sticky_spec else None,
            **({} if self.rewrite_model else {"rewrite_model": False}),
        }


def _body_field(body: Mapping[str, Any], path: str) -> Any:
    """`user`, or a dotted path into nested objects such as `metadata.session_id`."""
    value: Any = body
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def sticky_bucket(salt: str, key: str) -> int:
    return xxhash.xxh64_intdigest((salt + key).encode()) % BUCKETS


class Rollouts:
    """The rollout routes: which pool (and adapter) each route's model sends a request to, by its
    rules, weights and sticky keys; a model no route names goes to the pool serving it."""

    def __init__(self, routes: list[RouteConfig], pool_models: Mapping[str, str]) -> None:
        """`pool_models` maps each pool name to the model name it serves."""
        self.routes: dict[str, list[Rule]] = {
            r.model: [Rule.from_config(x, r.rewrite_model) for x in r.rules] for r in routes
        }
        self._direct: dict[str, str] = {}
        for pool, model in pool_models.items():
            self._direct.setdefault(model, pool)

    def resolve(self, model: str, headers: Mapping[str, str], body: Mapping[str, Any]) -> Choice | None:
        """Where this request goes, or None if the model is neither a route nor a pool's model."""
        rules = self.routes.get(model)
        if rules is None:
            pool = self._direct.get(model)
            return None if pool is None else Choice(pool)
        for rule in rules:
            if rule.matches(headers):
                pool = rule.pick(headers, body)
                if pool is None:
                    return None
                return Choice(pool, rule.adapters.get(pool), rule.rewrite_model)
        return None

    def pools_for(self, model: str) -> list[str] | None:
        """The pools a model's requests can reach (a rule's pools of positive weight, or the pool
        serving it directly); None for an unknown model."""
        rules = self.routes.get(model)
        if rules is None:
            direct = self._direct.get(model)
            return None if direct is None else [direct]
        names = {name: None for r in rules for name, w in zip(r.pools, r.weights, strict=True) if w > 0}
        return list(names)

    def rule(self, model: str, rule_index: int | None = None) -> tuple[int, Rule]:
        """A route's rule by index; by default its last rule (the weighted split, by convention)."""
        rules = self.routes.get(model)
        if rules is None:
            raise KeyError(f"no route {model!r}")
        index = len(rules) - 1 if rule_index is None else rule_index
        if not 0 <= index < len(rules):
            raise KeyError(f"route {model!r} has no rule {rule_index} (it has {len(rules)})")
        return index, rules[index]

    def weights(self, model: str, rule_index: int | None = None) -> dict[str, float]:
        _, rule = self.rule(model, rule_index)
        return dict(zip(rule.pools, rule.weights, strict=True))

    def set_weights(self, model: str, weights: Mapping[str, float], rule_index: int | None = None) -> int:
        """Change the weights of a route's rule (pools not named keep theirs); effective at once.

        Raises KeyError for an unknown route, rule or pool and ValueError for a negative
        weight or one that leaves the rule with no weight at all. Returns the rule's index.
        """
        index, rule = self.rule(model, rule_index)
        unknown = set(weights) - set(rule.pools)
        if unknown:
            raise KeyError(f"route {model!r} rule {index} has no pools {sorted(unknown)}")
        new = [float(weights.get(p, w)) for p, w in zip(rule.pools, rule.weights, strict=True)]
        if any(w < 0 for w in new):
            raise ValueError("weights must be >= 0")
        if sum(new) <= 0:
            raise ValueError(f"route {model!r} rule {index}: at least one pool needs a positive weight")
        rule.weights = new
        return index

    def describe(self) -> dict[str, list[dict[str, Any]]]:
        return {model: [r.describe() for r in rules] for model, rules in self.routes.items()}
