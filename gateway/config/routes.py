"""Routes: model names clients ask for, mapped to pools by header match and weighted, sticky splits."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from gateway.config.base import Strict

# Weights are relative, so their scale is free; bounded so that a rule's sum stays a finite number
# that tells its pools apart (two weights of 1e308 summed to infinity and sent everything to the
# second), and a positive weight is not a denormal that no request ever lands on.
MAX_WEIGHT = 1_000_000.0
MIN_POSITIVE_WEIGHT = 0.001


def check_weight(value: float) -> float:
    """A route weight as every path that sets one accepts it (the file, the admin API, shared state,
    `kvgate rollout weights`): 0 (out of the split) or between the bounds; ValueError says so."""
    if value != 0 and not MIN_POSITIVE_WEIGHT <= value <= MAX_WEIGHT:  # NaN fails both comparisons
        raise ValueError(
            f"a weight is 0 (out of the split) or from {MIN_POSITIVE_WEIGHT:g} to {MAX_WEIGHT:,.0f}, "
            f"not {value!r}"
        )
    return value


RouteWeight = Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(check_weight)]


class HeaderMatch(Strict):
    """Request headers a rule applies to."""

    headers: dict[str, str] = Field(
        default_factory=dict, description="Header name -> exact value; every one must match"
    )


class WeightedPool(Strict):
    """A pool in a rule's split."""

    name: str = Field(description="The pool's name (pools[].name)")
    weight: RouteWeight = Field(
        100.0,
        description="Its share of the rule's requests, relative to the others': 0 takes the pool out, "
        f"else from {MIN_POSITIVE_WEIGHT:g} to {MAX_WEIGHT:,.0f}",
    )
    adapter: str | None = Field(None, description="Serve the route with this LoRA adapter of the pool")


class StickyConfig(Strict):
    """Sticky assignment: a key (a user, a session) always lands on the same pool for given weights."""

    key: str = Field(
        "header:x-user-id|body:user",
        description="Sources tried in order, `|`-separated: header:NAME (e.g. a session id) or body:FIELD",
    )
    salt: str = Field("", description="Mixed into the key's hash: a new salt reshuffles who goes where")

    @field_validator("key")
    @classmethod
    def _sources(cls, v: str) -> str:
        for part in v.split("|"):
            kind, _, name = part.strip().partition(":")
            if kind not in ("header", "body") or not name:
                raise ValueError(f"source {part.strip()!r}: expected header:NAME or body:FIELD")
        return v


class RouteRule(Strict):
    """One rule of a route: the first rule whose match holds picks the pool."""

    match: HeaderMatch | None = Field(None, description="Headers the rule applies to; unset: every request")
    pools: list[WeightedPool] = Field(
        min_length=1, description="The pools the rule splits its requests among"
    )
    sticky: StickyConfig | None = Field(
        None, description="Keep each user (or session) on one pool; unset: each request drawn by weight"
    )


class RouteConfig(Strict):
    """A model name clients ask for, and the pools that serve it."""

    model: str = Field(description="The model name clients ask for")
    rules: list[RouteRule] = Field(
        min_length=1,
        description="Tried in order: the first whose match holds picks the pool (the admin API changes "
        "the last one's weights by default)",
    )
    rewrite_model: bool = Field(
        True,
        description="Responses name the model as the client asked for it, not the engine's name for it "
        "(a canary's internal model name never reaches clients)",
    )
