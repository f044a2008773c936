"""Precise prefix mode for one pool: the engine's own token ids, matched against what its KV
events say each replica really caches.

Approximate mode (the default) hashes blocks of prompt text and learns from its own routing
decisions. Precise mode instead asks an engine of the pool to tokenize the prompt (`POST
/tokenize`, which vLLM and the simulator answer with the chat template applied), hashes full
blocks of those token ids with `TokenBlockHasher`, and looks them up in an index that the
replicas' KV events keep (`KVEventIndexer`): blocks appear when an engine stores them and go
when it evicts them. A routing decision is recorded as speculative, covering the lag until the
engine's events confirm it.

The price is one loopback round trip to an engine per request, made by the preparation step
(gateway.path.prepare) with the token ids handed back here. Prompts the engine cannot
tokenize (the Responses API; a `/tokenize` failure) are never failed: they are matched against
the approximate index (text blocks learned from routing decisions), which the pool keeps too.

Precise mode never degrades silently. When a request that must make an engine store new blocks
has been routed to a replica and no usable event has come from it within `kv_events_timeout_s`
(its publisher never bound, the topic differs, the block size differs, the stream stopped), the
replica's events are `missing`: a warning is logged, `kvgate_kv_events_state` and the dashboard
show it, and the replica is matched against the approximate index (each such decision counted
in `kvgate_precise_fallback_decisions_total`) until its events come again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import orjson

from gateway.routing.kv_events import KVEventIndexer, KVEventSubscriber, TokenBlockHasher
from gateway.routing.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from gateway.config import PrefixConfig
    from gateway.fleet.replica import Replica
    from gateway.routing.policy import RequestFeatures

log = logging.getLogger(__name__)

EventsState = Literal["ok", "waiting", "missing"]
EVENTS_STATES: tuple[EventsState, ...] = ("ok", "waiting", "missing")
# The request fields that decide the engine's token ids (chat template input).
_CHAT_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt")


def tokenize_body(body: Mapping[str, Any], endpoint: str, model: str) -> dict[str, Any] | None:
    """The `/tokenize` request for a request body, or None when the engine has no such form."""
    if endpoint == "chat" and isinstance(body.get("messages"), list):
        return {"model": model, **{k: body[k] for k in _CHAT_FIELDS if k in body}}
    if endpoint == "completions" and isinstance(body.get("prompt"), str):
        return {"model": model, "prompt": body["prompt"]}
    return None


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class PrecisePrefix:
    def __init__(self, cfg: PrefixConfig, model: str, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.hasher = TokenBlockHasher(self.block_size, model)
        self.index = PrefixIndex.from_config(cfg)
        self.indexer = KVEventIndexer(self.index, self.hasher)
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.tokenize_failures = 0
        self.events_timeout_s = cfg.kv_events_timeout_s
        self.fallback_decisions: Counter[str] = Counter()  # per replica: routed on the approximate index
        self._reported: set[str] = set()  # replicas whose missing events were logged
        self._next = 0

    # -- replicas' event streams ---------------------------------------------------------
    def attach(self, replica: str, endpoint: str, topic: str = "") -> None:
        """Follow a replica's KV events. Its index starts empty: a (re)started engine is cold."""
        self.detach(replica)
        sub = self.subscribers[replica] = KVEventSubscriber(endpoint, replica, self.indexer, topic)
        if _loop_running():
            sub.start()

    def detach(self, replica: str) -> None:
        """Stop following a replica and forget its blocks (the pool drops it from the index)."""
        sub = self.subscribers.pop(replica, None)
        if sub is not None:
            sub.close()
        self.indexer.clear(replica)
        self._reported.discard(replica)
        self.fallback_decisions.pop(replica, None)

    # -- is each replica's event stream alive? ----------------------------------------------
    def expect_events(self, replica: str) -> None:
        """A request that must make the engine store new blocks was routed to `replica`."""
        sub = self.subscribers.get(replica)
        if sub is not None and sub.stats.awaiting_since is None:
            sub.stats.awaiting_since = time.monotonic()

    def events_state(self, replica: str, now: float | None = None) -> EventsState | None:
        """`ok` (events flow), `waiting` (none yet, none owed), `missing` (owed for longer than
        `kv_events_timeout_s`); None for a replica without a publisher. Logs each change to and
        from `missing` once."""
        sub = self.subscribers.get(replica)
        if sub is None:
            return None
        st = sub.stats
        now = time.monotonic() if now is None else now
        if st.awaiting_since is not None and now - st.awaiting_since > self.events_timeout_s:
            if replica not in self._reported:
                self._reported.add(replica)
                log.warning(
                    "precise prefix: no usable KV events from replica %s (%s, topic %r) %.1f s after "
                    "a request was routed to it; it is routed by the approximate index until they "
                    "come. Check that the engine binds its publisher (engines' ZMQ publishers bind only "
                    "an endpoint holding `*` or an ipc:// path), the topic, and the block size (%d "
                    "tokens expected)",
                    replica,
                    sub.endpoint,
                    sub.topic,
                    now - st.awaiting_since,
                    self.block_size,
                )
            return "missing"
        if replica in self._reported:
            self._reported.discard(replica)
            log.info("precise prefix: KV events from replica %s flow again", replica)
        return "ok" if st.last_event_at is not None else "waiting"

    def exact(self, replica: str, now: float) -> bool:
        """Whether the replica is matched against its KV events (else: the approximate index)."""
        state = self.events_state(replica, now)
        return state is not None and state != "missing"

    def start(self) -> None:
        """Start every subscriber not yet running (needs the running event loop)."""
        for sub in self.subscribers.values():
            sub.start()

    def close(self) -> None:
        for sub in self.subscribers.values():
            sub.close()

    # -- per request: the preparation step (gateway.path.prepare) asks an engine -------------
    def tokenize_request(self, body: Mapping[str, Any], endpoint: str) -> dict[str, Any] | None:
        """The `/tokenize` request for a request body, or None when the engine has no such form."""
        return tokenize_body(body, endpoint, self.model)

    def next_replica(self, replicas: Sequence[Replica]) -> Replica:
        """The replica to ask next (in turn, so no one engine tokenizes for all)."""
        self._next = (self._next + 1) % len(replicas)
        return replicas[self._next]

    def token_ids(self, replica: Replica, status: int, raw: bytes) -> list[int] | None:
        """The token ids in a `/tokenize` answer; None (counted) for anything else."""
        if status != 200:
            self.failed(replica, f"status {status}")
            return None
        try:
            ids = orjson.loads(raw)["tokens"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            self.failed(replica, "answer without a `tokens` list")
            return None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            self.failed(replica, "answer without a `tokens` list")
            return None
        return ids

    def failed(self, replica: Replica, why: str) -> None:
        self.tokenize_failures += 1
        log.debug("precise prefix: %s could not tokenize: %s", replica.name, why)

    def annotate(self, features: RequestFeatures, ids: list[int] | None) -> None:
        """Replace the request's text-block features by the engine's token-block ones, in place.

        Without token ids (none asked, or the engine could not tokenize) the request keeps no
        token-block hashes: the pool then matches its text-block hashes (kept in
        `text_block_hashes`) against the approximate index."""
        if ids is None:
            features.block_hashes, features.block_tokens = (), ()
            return
        hashes = self.hasher.hashes(ids)
        features.block_hashes = hashes
        features.block_tokens = [self.block_size] * len(hashes)
        features.prompt_tokens = len(ids)  # the engine's own count beats the gateway's estimate

    def set_capacity(self, replica: str, kv_tokens: int, cpu_tokens: int | None = None) -> None:
        """Bound the replica's entries per tier; the events decide what is held, the bound only
        keeps the index in memory if removals are lost."""
        self.index.set_capacity(replica, max(1, kv_tokens // self.block_size))
        if cpu_tokens:
            lower = self.index.add_lower_tier(self.index.default_capacity)
            lower.set_capacity(replica, max(1, cpu_tokens // self.block_size))
