"""The routing-policy plugin seam: what a policy sees, what it returns, and how one is loaded.

A policy ranks the candidate replicas of a pool for one request, best first; the proxy
walks that list on retries. Policies are found by name, in this order: an entry point in
the `kvgate.policies` group (the built-ins in `policies/` are registered exactly that way),
or a `"module:Class"` string. Their `args` are validated against the class's `Params`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.replica_speed import ReplicaSpeed


class ReplicaView(Protocol):
    """Read-only view of a replica (gateway.fleet.replica.Replica satisfies it)."""

    @property
    def name(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def available(self) -> bool: ...
    @property
    def inflight_requests(self) -> int: ...
    @property
    def inflight_tokens(self) -> int: ...
    # Other gateway instances' in-flight load on this replica (shared state backend; 0 when alone).
    @property
    def remote_inflight_requests(self) -> int: ...
    @property
    def remote_inflight_tokens(self) -> int: ...
    @property
    def engine(self) -> EngineLoad: ...
    @property
    def engine_fresh(self) -> bool: ...
    @property
    def kv_capacity_tokens(self) -> int | None: ...
    # Measured prefill and decode rates (None until enough requests completed there).
    @property
    def speed(self) -> ReplicaSpeed: ...


@dataclass(slots=True)
class RequestFeatures:
    """What is known about a request when it is routed."""

    request_id: str
    model: str
    pool: str
    endpoint: str  # "chat" | "completions" | "responses" | "embeddings" | "pooling" | ... (ENDPOINTS)
    prompt_tokens: int
    max_tokens: int | None = None
    block_hashes: Sequence[int] = ()
    block_tokens: Sequence[int] = ()
    priority: int = 1  # level: higher is more important
    priority_class: str = "default"
    tenant: str | None = None
    stream: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    text: str = ""  # the serialized prompt the hashes were taken over (for text-based policies)
    adapter: str | None = None  # the LoRA adapter serving it (None: the base model)
    # Precise prefix mode: `block_hashes` become the engine's token blocks; the text blocks stay
    # here for the replicas matched against the approximate index.
    text_block_hashes: Sequence[int] = ()
    text_block_tokens: Sequence[int] = ()


@dataclass(slots=True)
class Candidate:
    replica: ReplicaView
    matched_blocks: int = 0  # leading blocks of the request this replica is believed to hold
    matched_tokens: int = 0


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Policy:
    """Base class of routing policies. Subclasses set `Params` and implement `rank`."""

    Params: ClassVar[type[BaseModel]] = NoParams
    uses_prefix_match: ClassVar[bool] = False  # ask the proxy to fill Candidate.matched_*

    def __init__(self, params: BaseModel) -> None:
        self.params = params

    async def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        raise NotImplementedError

    def on_routed(self, request: RequestFeatures, replica: ReplicaView) -> None:
        """Called once the request was sent to `replica` (stateful policies learn here)."""


class PolicyLoadError(Exception):
    pass


def resolve_policy_class(type_name: str) -> type[Policy]:
    if ":" in type_name:
        module_name, _, attr = type_name.partition(":")
        try:
            obj: Any = getattr(importlib.import_module(module_name), attr)
        except ImportError as exc:
            raise PolicyLoadError(f"policy {type_name!r}: cannot import {module_name!r}: {exc}") from None
        except AttributeError:
            raise PolicyLoadError(f"policy {type_name!r}: {module_name!r} has no {attr!r}") from None
    else:
        found = [ep for ep in entry_points(group="kvgate.policies") if ep.name == type_name]
        if not found:
            known = sorted(ep.name for ep in entry_points(group="kvgate.policies"))
            raise PolicyLoadError(f"unknown policy {type_name!r}; known: {', '.join(known)}")
        try:
            obj = found[0].load()
        except Exception as exc:
            raise PolicyLoadError(f"policy {type_name!r}: loading {found[0].value} failed: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        raise PolicyLoadError(f"policy {type_name!r} is not a gateway.policy.Policy subclass")
    return obj


def load_policy(type_name: str, args: Mapping[str, Any] | None = None) -> Policy:
    cls = resolve_policy_class(type_name)
    try:
        params = cls.Params(**dict(args or {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise PolicyLoadError(f"policy {type_name!r} args.{key}: {first['msg']}") from None
    return cls(params)
