"""How a pool picks a replica: its routing policy, the prefix index and prompt canonicalization."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.config.base import Strict


class PolicyConfig(Strict):
    """A routing policy: which replica of the pool serves a request."""

    type: str = Field(
        "prefix_affinity", description="A policy's entry-point name (built-in or a plugin's) or module:Class"
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="The policy's own settings (docs/routing.md)"
    )
    max_candidates: int = Field(
        32,
        ge=0,
        description="In a pool of more replicas than this, a policy that uses prefix matches is offered "
        "only the replicas holding the most of the prompt's prefix (up to half of this) and a random "
        "sample of the others, plus any replica sharing a device with one of them: its decision time "
        "stops growing with the pool. 0: always every replica",
    )


class CanonicalizeRule(Strict):
    """A pattern of yours for volatile text (a user id, a ticket number)."""

    name: str = Field(description="The rule's name, in errors and in the debug log of what moved")
    pattern: str = Field(description="Python regex matching a volatile fragment")


class CanonicalizeConfig(Strict):
    """Rewriting prompts so that identical prefixes are identical (off unless enabled)."""

    enabled: bool = Field(False, description="Canonicalize this pool's prompts")
    move_volatile_to_end: bool = Field(
        True, description="Sentences of the leading system content that match a rule move to a trailing note"
    )
    rules: list[CanonicalizeRule] = Field(default_factory=list, description="Your volatile patterns")
    builtin_rules: list[str] = Field(
        default_factory=lambda: ["iso_datetime", "date", "time", "uuid"],
        description="Named built-in patterns to apply in addition to rules",
    )
    sort_tools: bool = Field(True, description="Tool definitions in a stable order (by name)")
    normalize_whitespace: bool = Field(
        True, description="System content's line ends made LF and trailing blanks removed"
    )
    opt_out_header: str = Field(
        "x-kvgate-no-canonicalize", description="A request sending this header (any value) is left as it is"
    )


class PrefixConfig(Strict):
    """The pool's prefix index: which replica holds which prompt prefix."""

    block_chars: int = Field(64, ge=8, description="Characters per hashed block (about 16 tokens)")
    max_blocks_per_replica: int | None = Field(
        None, gt=0, description="Index bound; unset: sized from the engine's KV capacity"
    )
    default_blocks_per_replica: int = Field(
        65536, gt=0, description="Index bound per replica until its engine reports its KV capacity"
    )
    token_cache_entries: int = Field(
        200_000, gt=0, description="Token counts of prompt blocks kept per pool (about 200 bytes each)"
    )
    speculative_ttl_s: float = Field(
        2.0,
        gt=0,
        description="Precise mode: a routed prompt's blocks count this long before the events confirm them",
    )
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
