"""The routing-policy plugin seam, API version 2: what a policy sees, what it returns, what it
hears back, and how one is loaded.

A policy ranks the candidate replicas of a pool for one request, best first (`rank`, synchronous:
nothing may happen between a decision and its lease); the proxy walks that list on retries. For a
pool with prefill and decode roles it picks both legs at once (`select_pair`, by default the
decode side by `rank` and the prefill side by load). It hears where each request was sent
(`on_routed`), when a streamed answer's first token came (`on_first_token`) and, exactly once per
ranked request, how it ended (`on_complete`). Policies are
found by name, in this order: an entry point in the `kvgate.policies` group (the built-ins in
`policies/` are registered exactly that way), or a `"module:Class"` string. Their `args` are
validated against the class's parameter model, `Policy[ThatModel]`.

Version 1 (an `async def rank`, `Params = Model` on an unparameterized `Policy`) still loads, for
one release, with a DeprecationWarning naming the class and what to change.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar, Generic, Protocol, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.replica_speed import ReplicaSpeed

log = logging.getLogger(__name__)

API_VERSION = 2  # what this gateway's plugin API is; a plugin may check `gateway.policy.API_VERSION`


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
    # Replicas with the same device time-share one GPU (None: a device of its own).
    @property
    def device(self) -> str | None: ...
    # Measured prefill and decode rates (None until enough requests completed there).
    @property
    def speed(self) -> ReplicaSpeed: ...


@dataclass(slots=True)
class RequestFeatures:
    """What is known about a request when it is routed."""

    request_id: str
    model: str
    pool: str
    endpoint: str  # "chat", "completions", "responses", "embeddings", ...: gateway.prompt.endpoints
    prompt_tokens: int
    max_tokens: int | None = None
    sequences: int = 1  # answers generated: n x prompts (what the expected output is charged per)
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
    matched_blocks: int = 0  # leading blocks of the request this replica is believed to hold (GPU)
    matched_tokens: int = 0
    # Blocks (tokens) it holds right after those in CPU memory (an engine offloading KV, e.g. vLLM's
    # --kv-offloading-size): loaded instead of recomputed, at the cost of a copy. 0 without a CPU tier.
    cpu_matched_blocks: int = 0
    cpu_matched_tokens: int = 0


@dataclass(slots=True, frozen=True)
class Outcome:
    """How a ranked request ended, as `on_complete` hears it. Times are from the gateway's receipt
    of the request; token figures are the engine's own (its usage) where it gave them."""

    ok: bool  # the engine's answer was relayed whole (a non-streamed one: read whole)
    status: int | None  # the HTTP status the client got; None when it went away before one
    error: str | None  # None, or the kind: "engine_error" (a 4xx/5xx answer), "upstream_error" (a
    # replica failed or cut its stream), "no_replica" (none took it), "client_disconnected" (or the
    # request was cancelled otherwise), "gateway_error" (anything else)
    ttft_s: float | None  # to the first byte relayed to the client
    e2e_s: float
    prompt_tokens: int  # the engine's count when it gave one, else the gateway's
    cached_tokens: int | None  # prompt tokens the engine reported served from its prefix cache
    attempts: int  # replicas tried, retries included
    prefill_replica: str | None = None  # the prefill leg's replica, for a disaggregated request


@dataclass(slots=True)
class Pair:
    """A prefill/decode decision: both legs ranked best first. The decode list is walked as a
    plain ranking is; the first prefill replica that admits the leg takes it (an empty list: the
    decode replica prefills itself)."""

    prefill: list[Candidate]
    decode: list[Candidate]


# -- scorers: the terms the built-ins rank by, written once, for plugins to compose too ----------
# A scorer gives a candidate a cost for one request, in tokens of work (lower is better), so terms
# add up: `rank_by(request, candidates, [(1.0, PrefixScorer()), (1.0, LoadScorer())])` is "least
# uncached prompt plus least work queued". `LoadScorer` is the one load term of the built-ins
# (least_load, prefix_affinity, the default prefill choice of `select_pair`); `PrefixScorer` the
# prefix term, for a policy with `uses_prefix_match`.


class Scorer(Protocol):
    def __call__(self, request: RequestFeatures, candidate: Candidate) -> float: ...


@dataclass(frozen=True, slots=True)
class LoadScorer:
    """Work in flight on a replica, counted from every source. The gateway's own figures are exact
    and current (a lease is taken at decision time), other gateways' (shared state) a sync interval
    old, and the engine's, counting everyone's, are used only while its scrape is fresh. They
    overlap (the gateways' requests are in the engine's too), so the larger counts, not the sum."""

    waiting_token_cost: int = 1024  # tokens of work assumed per request the engine reports

    # `fresh`: the replica's `engine_fresh`, when the caller has read it already (it reads the clock).
    def requests(self, r: ReplicaView, fresh: bool | None = None) -> int:
        n = r.inflight_requests + r.remote_inflight_requests
        if r.engine_fresh if fresh is None else fresh:
            engine = r.engine
            return max(n, engine.running + engine.waiting)
        return n

    def tokens(self, r: ReplicaView, fresh: bool | None = None) -> int:
        n = r.inflight_tokens + r.remote_inflight_tokens
        if r.engine_fresh if fresh is None else fresh:
            engine = r.engine
            return max(n, (engine.waiting + engine.running) * self.waiting_token_cost)
        return n

    def __call__(self, request: RequestFeatures, candidate: Candidate) -> float:
        return self.tokens(candidate.replica)


def per_device(candidates: Sequence[Candidate], values: Sequence[float]) -> list[float]:
    """Each candidate's value summed over the candidates on its device (`ReplicaView.device`).

    Engine processes time-sharing a GPU each read all the weights every step and queue for the
    same compute, so work on one of them delays them all and moving work between them frees
    nothing: on one H200, two busy vLLM replicas of four decoded at 15 ms a token where four busy
    ones took 25. A replica without a device keeps its own value."""
    totals: dict[str, float] = {}
    for c, v in zip(candidates, values, strict=True):
        device = c.replica.device
        if device is not None:
            totals[device] = totals.get(device, 0.0) + v
    if not totals:
        return list(values)
    return [
        v if (d := c.replica.device) is None else totals[d] for c, v in zip(candidates, values, strict=True)
    ]


# relative_prefill_speeds' guards against a few odd measurements (chats prefilled in a document's
# last step once read 17x the pool's pace, and their replica drew 317 of 400 requests): a size
# class counts for a replica from this many recent requests in it, and its ratio is held within
# RELATIVE_BOUNDS.
RELATIVE_MIN_CLASS_REQUESTS = 2.0
RELATIVE_BOUNDS = (0.25, 4.0)  # an A100 prefills about a third as fast as an H100


def relative_prefill_speeds(candidates: Sequence[Candidate]) -> list[float | None]:
    """Each candidate's prefill speed relative to the others', compared on requests of like size:
    per size class (`ReplicaSpeed.by_size`), its rate over the class's rate pooled over the
    measured candidates, averaged with the weights of its own recent requests in each class. So
    replicas alike read about 1.0 whatever mix each served (their overall rates do not: overheads
    weigh on short prompts), and one twice as fast on every size reads twice another's (within
    RELATIVE_BOUNDS; 1.0 without two recent requests in any class). None where not measured yet
    (`speed.prefill_tokens_per_s` is None)."""
    speeds = [c.replica.speed for c in candidates]
    pooled: dict[int, list[float]] = {}
    for speed in speeds:
        if speed.prefill_tokens_per_s is not None:
            for size, (tokens, seconds, _) in speed.by_size.items():
                sums = pooled.setdefault(size, [0.0, 0.0])
                sums[0] += tokens
                sums[1] += seconds
    low, high = RELATIVE_BOUNDS
    relative: list[float | None] = []
    for speed in speeds:
        if speed.prefill_tokens_per_s is None:
            relative.append(None)
            continue
        weighed = weights = 0.0
        for size, (tokens, seconds, requests) in speed.by_size.items():
            # A class prefilled in no time of its own says nothing; one or two requests, too little.
            if tokens > 0 and seconds > 0 and requests >= RELATIVE_MIN_CLASS_REQUESTS:
                all_tokens, all_seconds = pooled[size]
                ratio = (tokens / seconds) / (all_tokens / all_seconds)
                weighed += requests * min(high, max(low, ratio))
                weights += requests
        relative.append(weighed / weights if weights else 1.0)
    return relative


def uncached_tokens(prompt_tokens: int, matched_tokens: int) -> int:
    """The prompt tokens a replica holding `matched_tokens` of it still has to prefill."""
    return prompt_tokens - matched_tokens if prompt_tokens > matched_tokens else 0


@dataclass(frozen=True, slots=True)
class PrefixScorer:
    """The prompt tokens a candidate would prefill: those it is not believed to hold already."""

    def __call__(self, request: RequestFeatures, candidate: Candidate) -> float:
        return uncached_tokens(request.prompt_tokens, candidate.matched_tokens)


def rank_by(
    request: RequestFeatures, candidates: Sequence[Candidate], terms: Sequence[tuple[float, Scorer]]
) -> list[Candidate]:
    """The candidates by the weighted sum of the scorers' costs, lowest first; ties keep their order."""
    return sorted(candidates, key=lambda c: sum(weight * score(request, c) for weight, score in terms))


def least_loaded(candidates: Sequence[Candidate], load: LoadScorer, turn: int) -> list[Candidate]:
    """Fewest tokens in flight first, then fewest requests; equal loads (an idle fleet) rotate with
    `turn` instead of always falling to the first replica."""
    n = len(candidates)

    def key(item: tuple[int, Candidate]) -> tuple[int, int, int]:
        i, c = item
        r = c.replica
        return (load.tokens(r), r.inflight_requests + r.remote_inflight_requests, (i - turn) % n)

    return [c for _, c in sorted(enumerate(candidates), key=key)]


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


ParamsT = TypeVar("ParamsT", bound=BaseModel)

# How the default `select_pair` costs a prefill replica's queue: least_load's default.
_PREFILL_LOAD = LoadScorer()


class Policy(Generic[ParamsT]):
    """Base class of routing policies: subclass `Policy[YourParams]` (or plain `Policy` without
    arguments) and implement `rank`; the other hooks are optional."""

    Params: ClassVar[type[BaseModel]] = NoParams  # set from the class's type argument
    uses_prefix_match: ClassVar[bool] = False  # ask the proxy to fill Candidate.matched_*
    api_version: ClassVar[int] = API_VERSION  # 1 for a class still written against version 1
    # What a version-1 class should change, said when it is loaded.
    v1_changes: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        typed = _params_argument(cls)
        if typed is not None:
            cls.Params = typed
        changes = []
        rank = cls.__dict__.get("rank")
        if inspect.iscoroutinefunction(rank):
            setattr(cls, "rank", _synchronous(rank))  # noqa: B010 (assigning a method is not typed)
            changes.append("`async def rank` -> `def rank` (it must not await)")
        if "Params" in cls.__dict__ and typed is None:
            name = cls.Params.__name__
            changes.append(f"`Params = {name}` -> `class {cls.__name__}(Policy[{name}])` (self.params typed)")
        if changes:
            cls.api_version = 1
            cls.v1_changes = tuple(changes)

    def __init__(self, params: ParamsT) -> None:
        self.params = params
        self._prefill_turn = 0

    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        raise NotImplementedError

    def select_pair(
        self, request: RequestFeatures, prefill: Sequence[Candidate], decode: Sequence[Candidate]
    ) -> Pair:
        """Both legs of a disaggregated pool's request (called for every request of such a pool;
        the proxy disaggregates only when the first decode replica lacks enough of the prompt).
        By default: decode by `rank`, prefill by least load (the prefill replica holds nothing
        of the request for long: its KV moves to the decode replica)."""
        self._prefill_turn += 1
        return Pair(least_loaded(prefill, _PREFILL_LOAD, self._prefill_turn), self.rank(request, decode))

    def on_routed(self, request: RequestFeatures, replica: ReplicaView) -> None:
        """Called once the request was sent to `replica` (after a retry, the replica that finally
        took it; stateful policies learn at decision time here). Not called for a prefill leg."""

    def on_first_token(self, request: RequestFeatures, replica: ReplicaView) -> None:
        """Called at most once per ranked request, when the first bytes of a streamed answer (its
        first token) came from `replica`, before `on_complete`: its prefill is over. Not called for
        a non-streamed answer (its first byte is its end) nor an error. A policy must stay correct
        if it never comes: gateways before this hook do not call it."""

    def on_complete(self, request: RequestFeatures, replica: ReplicaView | None, outcome: Outcome) -> None:
        """Called exactly once for every request this policy ranked, when it ended, however it
        ended, with the decode (or only) replica that last took it (None when none did)."""


def _params_argument(cls: type) -> type[BaseModel] | None:
    """The parameter model named in the class's own bases, `Policy[Model]`."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Policy):
            args = get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                return args[0]
    return None


RankV1 = Callable[[Any, RequestFeatures, Sequence[Candidate]], Coroutine[Any, Any, list[Candidate]]]


def _synchronous(rank: RankV1) -> Callable[[Any, RequestFeatures, Sequence[Candidate]], list[Candidate]]:
    """A version-1 `async def rank` run to its end on the spot: it never awaited anything slow
    (the contract then too), so it finishes without the event loop."""

    @functools.wraps(rank)
    def run(self: Any, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        coro = rank(self, request, candidates)
        try:
            while coro.send(None) is None:  # a bare yield (asyncio.sleep(0)) just goes on
                pass
        except StopIteration as done:
            return done.value
        coro.close()
        raise RuntimeError(f"policy {type(self).__qualname__}.rank awaited a future: rank must not await")

    return run


class PolicyLoadError(Exception):
    pass


def resolve_policy_class(type_name: str) -> type[Policy[Any]]:
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


def load_policy(type_name: str, args: Mapping[str, Any] | None = None) -> Policy[Any]:
    cls = resolve_policy_class(type_name)
    if cls.v1_changes:
        message = (
            f"routing policy {type_name!r} ({cls.__module__}.{cls.__qualname__}) uses plugin API "
            f"version 1, deprecated and removed in the next release: {'; '.join(cls.v1_changes)}"
        )
        # Operators see the log (warnings are filtered by default); tools and tests the warning.
        log.warning("%s", message)
        warnings.warn(message, DeprecationWarning, stacklevel=2)
    try:
        params = cls.Params(**dict(args or {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise PolicyLoadError(f"policy {type_name!r} args.{key}: {first['msg']}") from None
    return cls(params)
