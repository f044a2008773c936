"""Routes: model names clients ask for, mapped to pools by header match and weighted, sticky splits."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.base import Strict


class HeaderMatch(Strict):
    """Request headers a rule applies to."""

    headers: dict[str, str] = Field(
        default_factory=dict, description="Header name -> exact value; every one must match"
    )


class WeightedPool(Strict):
    """A pool in a rule's split."""

    name: str = Field(description="The pool's name (pools[].name)")
    weight: float = Field(
        100.0, ge=0, description="Its share of the rule's requests, relative to the others'"
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
