"""How a pool picks a replica: its routing policy, the prefix index and prompt canonicalization."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.config.base import Strict


class PolicyConfig(Strict):
    type: str = "prefix_affinity"
    args: dict[str, Any] = Field(default_factory=dict)
    max_candidates: int = Field(
        32,
        ge=0,
        description="In a pool of more replicas than this, a policy that uses prefix matches is offered "
        "only the replicas holding the most of the prompt's prefix (up to half of this) and a random "
        "sample of the others, plus any replica sharing a device with one of them: its decision time "
        "stops growing with the pool. 0: always every replica",
    )


class CanonicalizeRule(Strict):
    name: str
    pattern: str = Field(description="Python regex matching a volatile fragment")


class CanonicalizeConfig(Strict):
    enabled: bool = False
    move_volatile_to_end: bool = True
    rules: list[CanonicalizeRule] = Field(default_factory=list)
    builtin_rules: list[str] = Field(
        default_factory=lambda: ["iso_datetime", "date", "time", "uuid"],
        description="Named built-in patterns to apply in addition to rules",
    )
    sort_tools: bool = True
    normalize_whitespace: bool = True
    opt_out_header: str = "x-kvgate-no-canonicalize"


class PrefixConfig(Strict):
    block_chars: int = Field(64, ge=8, description="Characters per hashed block (about 16 tokens)")
    max_blocks_per_replica: int | None = Field(
        None, gt=0, description="Index bound; unset: sized from the engine's KV capacity"
    )
    default_blocks_per_replica: int = Field(65536, gt=0)
    token_cache_entries: int = Field(
        200_000, gt=0, description="Token counts of prompt blocks kept per pool (about 200 bytes each)"
    )
    speculative_ttl_s: float = Field(2.0, gt=0)
    max_learn_blocks: int = Field(
        8192,
        gt=0,
        description="Leading blocks of one prompt the index learns (about 130k tokens): a longer prompt "
        "is routed by its head, and learning all of it would hold the event loop",
    )
    mode: Literal["approximate", "precise"] = Field(
        "approximate",
        description="approximate: text blocks learned from routing decisions; precise: the engine's "
        "token ids (POST /tokenize) matched against its KV events",
    )
    engine_block_size: int | None = Field(
        None, gt=0, description="Precise mode: tokens per engine KV block (unset: engines.block_size or 16)"
    )
    kv_events_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Precise mode: a replica whose KV events have not come this long after a request "
        "was routed to it is reported (metric, warning, dashboard) and routed by the approximate index "
        "until they come again",
    )
