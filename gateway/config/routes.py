"""Routes: model names clients ask for, mapped to pools by header match and weighted, sticky splits."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.base import Strict


class HeaderMatch(Strict):
    headers: dict[str, str] = Field(default_factory=dict)


class WeightedPool(Strict):
    name: str
    weight: float = Field(100.0, ge=0)
    adapter: str | None = Field(None, description="Serve the route with this LoRA adapter of the pool")


class StickyConfig(Strict):
    key: str = Field(
        "header:x-user-id|body:user",
        description="Sources tried in order, `|`-separated: header:NAME (e.g. a session id) or body:FIELD",
    )
    salt: str = ""

    @field_validator("key")
    @classmethod
    def _sources(cls, v: str) -> str:
        for part in v.split("|"):
            kind, _, name = part.strip().partition(":")
            if kind not in ("header", "body") or not name:
                raise ValueError(f"source {part.strip()!r}: expected header:NAME or body:FIELD")
        return v


class RouteRule(Strict):
    match: HeaderMatch | None = None
    pools: list[WeightedPool] = Field(min_length=1)
    sticky: StickyConfig | None = None


class RouteConfig(Strict):
    model: str = Field(description="The model name clients ask for")
    rules: list[RouteRule] = Field(min_length=1)
    rewrite_model: bool = Field(
        True,
        description="Responses name the model as the client asked for it, not the engine's name for it "
        "(a canary's internal model name never reaches clients)",
    )
