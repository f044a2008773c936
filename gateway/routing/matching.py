"""Which replicas hold how much of a prompt: one facade over a pool's prefix indexes.

Approximate mode learns each replica's blocks from the routing decisions themselves (text blocks,
`learn`); precise mode matches the engines' own token blocks against their KV events, with the
approximate index as the fallback for replicas whose events are missing. A replica whose engine
offloads KV to CPU memory has a second tier in either index: its candidates say how many of the
prompt's blocks beyond those on the GPU it can load instead of recompute.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gateway.config import KVEventsSource, PoolConfig
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.routing.policy import Candidate, Policy, RequestFeatures
from gateway.routing.precise_prefix import PrecisePrefix
from gateway.routing.prefix_index import PrefixIndex


def _matched(
    index: PrefixIndex, hashes: Sequence[int], block_tokens: Sequence[int], replicas: list[Replica]
) -> list[Candidate]:
    """Candidates with the leading blocks of `hashes` each replica holds in `index`, and those
    it holds beyond them in CPU memory when the index has that tier."""
    if not hashes or not replicas:
        return [Candidate(r) for r in replicas]
    names = [r.name for r in replicas]
    if index.lower is None:
        matched = index.match(hashes, names)
        # A prefix held by many replicas gives them few distinct depths: sum each depth once, not
        # once per replica (up to 0.4 ms for a 2k-token prompt on 256 replicas).
        tokens = {k: sum(block_tokens[:k]) for k in set(matched.values())}
        return [Candidate(r, matched[r.name], tokens[matched[r.name]]) for r in replicas]
    tiers = index.match_tiers(hashes, names)
    tokens = {k: sum(block_tokens[:k]) for k in {d for pair in tiers.values() for d in pair}}
    out = []
    for r in replicas:
        gpu, reach = tiers[r.name]
        out.append(Candidate(r, gpu, tokens[gpu], reach - gpu, tokens[reach] - tokens[gpu]))
    return out


class PrefixMatch:
    def __init__(self, cfg: PoolConfig, upstream_model: str) -> None:
        self.cfg = cfg.prefix
        # Workers sharing one replica's CPU tier (a managed fleet's tensor-parallel size; else 1).
        self.workers = cfg.engines.tensor_parallel_size if cfg.engines is not None else 1
        self.precise = (
            PrecisePrefix(cfg.prefix, upstream_model, cfg.engine_block_size)
            if cfg.prefix.mode == "precise"
            else None
        )
        # `learn` records whole prompts' chains, and nothing is discarded: prefix-closed. In
        # precise mode it is the fallback for replicas whose KV events are missing.
        approximate = PrefixIndex.from_config(cfg.prefix, prefix_closed=True)
        self.index = self.precise.index if self.precise is not None else approximate
        self.fallback = approximate if self.precise is not None else None
        self._cpu_tiers: set[str] = set()  # replicas the approximate index models a CPU tier for

    @property
    def approximate(self) -> PrefixIndex:
        """The index learned from routing decisions (the fallback in precise mode)."""
        return self.fallback or self.index

    def share(self, shared: Callable[[PrefixIndex], PrefixIndex]) -> None:
        """Replace the approximate index by one shared with other gateways (not in precise mode,
        where the engines' events are every gateway's truth)."""
        if self.precise is None:
            self.index = shared(self.index)

    # -- membership ---------------------------------------------------------------------
    def added(self, name: str, kv_events: KVEventsSource | None) -> None:
        if self.precise is not None and kv_events is not None:
            self.precise.attach(name, kv_events)

    def removed(self, name: str) -> None:
        self.index.remove_replica(name)
        if self.fallback is not None:
            self.fallback.remove_replica(name)
        self._cpu_tiers.discard(name)
        if self.precise is not None:
            self.precise.detach(name)

    def set_capacity(self, replica: Replica, tokens_per_block: Callable[[], float]) -> None:
        """Size the replica's index budget from the engine's KV capacity, when it is known (and
        its CPU tier's from the engine's offloading size); `tokens_per_block` says how many tokens
        a block holds now."""
        cap = replica.kv_capacity_tokens
        cpu = replica.engine.cpu_capacity_tokens
        if cpu:
            # vLLM 0.26 splits --kv-offloading-size among its workers, each keeping blocks of its
            # own shard (OffloadingConnector): the tier holds 1/TP of what its bytes suggest.
            cpu //= self.workers
        if cap and self.precise is not None:
            self.precise.set_capacity(replica.name, cap, cpu)
        approximate = self.approximate
        if cap and self.cfg.max_blocks_per_replica is None:
            per_block = tokens_per_block()
            approximate.set_capacity(replica.name, max(1, int(cap / per_block)))
            if cpu:
                lower = approximate.add_lower_tier(approximate.default_capacity)
                lower.set_capacity(replica.name, max(1, int(cpu / per_block)))
                self._cpu_tiers.add(replica.name)
        if not cpu and replica.name in self._cpu_tiers:  # restarted without its CPU tier
            self._cpu_tiers.discard(replica.name)
            if approximate.lower is not None:
                approximate.lower.clear_replica(replica.name)

    # -- per request --------------------------------------------------------------------
    def candidates(self, features: RequestFeatures, replicas: Iterable[Replica]) -> list[Candidate]:
        """The replicas as candidates, each with the prompt's blocks it is believed to hold."""
        replicas = list(replicas)
        if self.precise is None or self.fallback is None:
            return _matched(self.index, features.block_hashes, features.block_tokens, replicas)
        # Precise mode: replicas whose KV events flow are matched on the engine's token blocks,
        # the others (events missing, no publisher, or the prompt could not be tokenized) on
        # the text blocks of the approximate index.
        now = time.monotonic()
        exact: list[Replica] = []
        fallback = replicas
        if features.block_hashes:
            flags = [self.precise.exact(r.name, now) for r in replicas]
            exact = [r for r, ok in zip(replicas, flags, strict=True) if ok]
            fallback = [r for r, ok in zip(replicas, flags, strict=True) if not ok]
        found = _matched(self.index, features.block_hashes, features.block_tokens, exact)
        found += _matched(self.fallback, features.text_block_hashes, features.text_block_tokens, fallback)
        if not exact or not fallback:
            return found
        order = {r.name: i for i, r in enumerate(replicas)}
        return sorted(found, key=lambda c: order[c.replica.name])

    def holders(self, features: RequestFeatures, limit: int, rng: random.Random) -> list[str]:
        """Up to `limit` replicas per index holding the prompt's blocks, deepest match first."""
        found = self.index.holders(features.block_hashes, limit, rng)
        if self.fallback is not None:  # precise mode: replicas without KV events, by text blocks
            found += self.fallback.holders(features.text_block_hashes, limit, rng)
        return found

    def shortlist(
        self, pool: Pool, features: RequestFeatures, role: str, limit: int, rng: random.Random
    ) -> list[Replica]:
        """The replicas a prefix-matching policy is offered for a leg in a pool larger than `limit`.

        Every stage of a decision (availability, the index match, the policy's estimate) is per
        replica: at 1,024 replicas they took a millisecond. The prompt's best holders (deepest match
        first) keep its cache hits, a uniform sample of the others keeps load in view (a least-loaded
        pick among 16 random replicas is within a few requests of the global one), and the replicas
        sharing a GPU with any of them come along, as a policy sums load per device."""
        chosen: dict[Replica, None] = {}
        for name in self.holders(features, limit // 2, rng):
            replica = pool.replicas.get(name)
            if replica is not None and pool.takes(replica, role):  # the index holds either leg
                chosen[replica] = None
        for replica in rng.sample(pool.members(role), limit):
            if len(chosen) >= limit:
                break
            chosen[replica] = None
        for device in {r.device for r in chosen if r.device is not None}:
            chosen.update(dict.fromkeys(pool.on_device(role, device)))
        return [r for r in chosen if r.available]

    def learn(self, features: RequestFeatures, name: str, deciding: Policy[Any] | None) -> None:
        """The request went to replica `name`: it will hold the prompt's blocks once prefilled."""
        # A prompt longer than this is learned by its head: all of it would hold the event loop.
        limit = self.cfg.max_learn_blocks
        if self.precise is None or self.fallback is None:
            if features.block_hashes:
                self.index.record(name, features.block_hashes[:limit])
                self._learn_cpu(name, features.block_hashes[:limit])
            return
        blocks = features.block_hashes[:limit]
        if blocks:
            # New blocks for the engine to store: its events owe us a BlockStored.
            if self.index.match(blocks, [name])[name] < len(blocks):
                self.precise.expect_events(name)
            # The engine's events confirm; until then the decision is a guess.
            self.index.record(name, blocks, speculative=True)
        if features.text_block_hashes:
            self.fallback.record(name, features.text_block_hashes[:limit])
            self._learn_cpu(name, features.text_block_hashes[:limit])
        if (
            deciding is not None
            and deciding.uses_prefix_match
            and not (blocks and self.precise.exact(name, time.monotonic()))
        ):
            self.precise.fallback_decisions[name] += 1

    def _learn_cpu(self, replica: str, hashes: Sequence[int]) -> None:
        """The approximate index's CPU tier, for a replica whose engine offloads: vLLM writes prompt
        blocks through to CPU as they are computed, so the tier is a second, larger LRU over the
        same blocks, not a demotion target."""
        lower = self.approximate.lower
        if lower is not None and replica in self._cpu_tiers:
            lower.record(replica, hashes)
