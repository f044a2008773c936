"""Which prefix blocks each replica is believed to hold warm, and how deep a prompt matches on each.

Block hashes are chained (see gateway.prompt.prefix_hash), so a replica's useful match is its number of
LEADING blocks: the walk stops at the first block it lacks. Each replica is given a bit, and each
hash maps to a bitmask of the replicas holding it, so one walk step is a dict lookup and an integer
AND whatever the number of replicas; the walk ends as soon as no candidate is left. It runs as
C-level iteration, with no Python code per block (expired speculative entries are purged first).

Where every `record` is a whole chain from its first block and nothing is discarded (approximate
mode: `prefix_closed=True`), a replica that holds block i of a chain also holds blocks 0..i-1:
a record touches a chain's head after its tail, so the LRU evicts the tail first. The masks along
a prompt then only shrink, and `match` finds where they change by galloping and bisection, a few
lookups for a prompt of hundreds of blocks. `discard` and speculative entries break the property;
the first of either turns the bisection off for good.

Memory is bounded per replica by an LRU (capacity in blocks, set from the engine's KV capacity
with `set_capacity`). `record` touches a prompt's blocks from last to first, so that, as in vLLM's
free-block queue, a prompt's tail is evicted before its shared head.

Entries are confirmed (learned from a routing decision in approximate mode, or from an engine KV
event in precise mode) or speculative: in precise mode a routing decision records speculative
entries that cover the engine's event lag and expire after `speculative_ttl_s` unless an event
confirms them. `snapshot`/`merge` export and import one replica's entries (LRU order, oldest
first), for a shared backend.

A replica whose engine offloads KV blocks to CPU memory (vLLM's OffloadingConnector) has a second
tier: `add_lower_tier` gives the index a `lower` PrefixIndex that shares its replicas' bits, so that
`match_tiers` walks both at once and tells, per replica, how many leading blocks it holds on the GPU
and how many more it can load from CPU. The tiers are not exclusive: vLLM writes blocks through to
CPU as they are computed, so a block is often in both, and it stays matchable on CPU after the GPU
evicted it, until the CPU tier's own LRU does.

Not thread-safe: meant for the gateway's event loop.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat, takewhile
from operator import and_, or_

from gateway.config import PrefixConfig


@dataclass(slots=True)
class _Replica:
    bit: int
    capacity: int
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first
    speculative: dict[int, float] = field(default_factory=dict)  # hash -> expiry


class PrefixIndex:
    def __init__(
        self,
        default_capacity: int = 65536,
        speculative_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        prefix_closed: bool = False,
        bits_from: PrefixIndex | None = None,
    ) -> None:
        if default_capacity < 1:
            raise ValueError("default_capacity must be positive")
        self.default_capacity = default_capacity
        self.speculative_ttl_s = speculative_ttl_s
        self.prefix_closed = prefix_closed  # see the module docstring
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._names: dict[int, str] = {}  # bit -> replica id
        self._masks: dict[str, int] = {}  # replica id -> 1 << bit
        self._everyone = 0  # the mask of all replicas
        self._free_bits: list[int] = []
        self._confirmed: dict[int, int] = {}  # hash -> bitmask of replicas
        self._speculative: dict[int, int] = {}  # hash -> bitmask, expiry kept per replica
        # Every replica's speculative entries in time order (the TTL is fixed): expired ones are
        # purged before a walk, so the walk can trust both maps without checking a clock per block.
        self._expiries: deque[tuple[float, _Replica, int]] = deque()
        # A lower tier takes its replicas' bits from the tier above, so masks of both can be OR-ed.
        self._bits_from = bits_from
        self.lower: PrefixIndex | None = None

    @classmethod
    def from_config(
        cls, cfg: PrefixConfig, clock: Callable[[], float] = time.monotonic, prefix_closed: bool = False
    ) -> PrefixIndex:
        return cls(
            default_capacity=cfg.max_blocks_per_replica or cfg.default_blocks_per_replica,
            speculative_ttl_s=cfg.speculative_ttl_s,
            clock=clock,
            prefix_closed=prefix_closed,
        )

    # --- replicas -------------------------------------------------------------------------

    def _replica(self, replica: str) -> _Replica:
        state = self._replicas.get(replica)
        if state is None:
            if self._bits_from is not None:
                bit = self._bits_from._replica(replica).bit
            else:
                bit = self._free_bits.pop() if self._free_bits else len(self._names)
            state = self._replicas[replica] = _Replica(bit=bit, capacity=self.default_capacity)
            self._names[bit] = replica
            self._masks[replica] = 1 << bit
            self._everyone |= 1 << bit
        return state

    def add_lower_tier(self, default_capacity: int) -> PrefixIndex:
        """Model a lower tier (CPU memory) under this one; returns it (idempotent)."""
        if self.lower is None:
            self.lower = PrefixIndex(default_capacity, self.speculative_ttl_s, self._clock, bits_from=self)
        return self.lower

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Bound a replica's entries (e.g. num_gpu_blocks * block_size / tokens per hashed block)."""
        if blocks < 1:
            raise ValueError("capacity must be positive")
        state = self._replica(replica)
        state.capacity = blocks
        self._evict(state)

    def remove_replica(self, replica: str) -> None:
        if self.lower is not None:
            self.lower.remove_replica(replica)
        state = self._replicas.get(replica)
        if state is None:
            return
        self._drop_all(state)
        del self._replicas[replica]
        del self._names[state.bit]
        del self._masks[replica]
        self._everyone &= ~(1 << state.bit)
        if self._bits_from is None:
            self._free_bits.append(state.bit)

    def clear_replica(self, replica: str) -> None:
        """Forget everything a replica holds (engine restart, AllBlocksCleared), every tier; keeps
        its capacity."""
        if self.lower is not None:
            self.lower.clear_replica(replica)
        state = self._replicas.get(replica)
        if state is not None:
            self._drop_all(state)

    def _drop_all(self, state: _Replica) -> None:
        for h in state.lru:
            self._unset(h, ~(1 << state.bit))
        state.lru.clear()
        state.speculative.clear()  # its queued expiries are stale now, and skipped

    # --- learning -------------------------------------------------------------------------

    def record(self, replica: str, block_hashes: Sequence[int], speculative: bool = False) -> None:
        """`replica` now holds these blocks; they become its most recently used, head last."""
        state = self._replica(replica)
        now = self._clock()
        self._expire(now)
        bit = 1 << state.bit
        lru = state.lru
        confirmed = self._confirmed
        if speculative:
            self.prefix_closed = False
            expiry = now + self.speculative_ttl_s
            spec = self._speculative
            for h in reversed(block_hashes):
                if h in lru:
                    lru.move_to_end(h)
                else:
                    lru[h] = None
                if not confirmed.get(h, 0) & bit:
                    spec[h] = spec.get(h, 0) | bit
                    state.speculative[h] = expiry
                    self._expiries.append((expiry, state, h))
        else:
            for h in reversed(block_hashes):
                if h in lru:
                    lru.move_to_end(h)
                    if state.speculative.pop(h, None) is not None:
                        self._unset_speculative(h, ~bit)
                else:
                    lru[h] = None
                confirmed[h] = confirmed.get(h, 0) | bit
        self._evict(state)

    def merge(self, replica: str, block_hashes: Iterable[int]) -> None:
        """Import confirmed entries given oldest first (the order `snapshot` returns)."""
        self.record(replica, list(block_hashes)[::-1])

    def discard(self, replica: str, block_hashes: Iterable[int]) -> None:
        """The replica no longer holds these blocks (e.g. an engine BlockRemoved event)."""
        self.prefix_closed = False
        state = self._replicas.get(replica)
        if state is None:
            return
        keep = ~(1 << state.bit)
        for h in block_hashes:
            if h in state.lru:
                del state.lru[h]
                state.speculative.pop(h, None)
                self._unset(h, keep)

    def _unset(self, h: int, keep: int) -> None:
        mask = self._confirmed.get(h)
        if mask is not None:
            mask &= keep
            if mask:
                self._confirmed[h] = mask
            else:
                del self._confirmed[h]
        self._unset_speculative(h, keep)

    def _unset_speculative(self, h: int, keep: int) -> None:
        mask = self._speculative.get(h)
        if mask is not None:
            mask &= keep
            if mask:
                self._speculative[h] = mask
            else:
                del self._speculative[h]

    def _evict(self, state: _Replica) -> None:
        lru = state.lru
        keep = ~(1 << state.bit)
        while len(lru) > state.capacity:
            h, _ = lru.popitem(last=False)
            state.speculative.pop(h, None)
            self._unset(h, keep)

    def _expire(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expiry, state, h = expiries.popleft()
            # Skip stale queue entries: the block was since refreshed, confirmed or dropped.
            if state.speculative.get(h) == expiry:
                del state.speculative[h]
                del state.lru[h]
                self._unset_speculative(h, ~(1 << state.bit))

    # --- queries --------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` each of `replicas` holds (0 if unknown)."""
        result = dict.fromkeys(replicas, 0)
        # Built with C-level iteration: at 256 replicas a Python loop here would dominate the walk.
        want = sum(filter(None, map(self._masks.get, result)))
        names = self._names
        for mask, depth in self._levels(block_hashes, want):
            while mask:
                low = mask & -mask
                mask ^= low
                result[names[low.bit_length() - 1]] = depth
        return result

    def match_tiers(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, tuple[int, int]]:
        """Per replica: (leading blocks held on this tier, leading blocks held on this tier or the
        lower one). A block counts on either; a walk over the lower tier alone would miss the blocks
        only the GPU still holds."""
        top = self.match(block_hashes, replicas)
        lower = self.lower
        if lower is None or not lower._confirmed:
            return {name: (depth, depth) for name, depth in top.items()}
        reach = dict.fromkeys(top, 0)
        want = sum(filter(None, map(self._masks.get, reach)))
        names = self._names
        for mask, depth in self._levels(block_hashes, want, lower._confirmed):
            while mask:
                low = mask & -mask
                mask ^= low
                reach[names[low.bit_length() - 1]] = depth
        return {name: (depth, max(depth, reach[name])) for name, depth in top.items()}

    def holders(self, block_hashes: Sequence[int], limit: int, rng: random.Random) -> list[str]:
        """Up to `limit` replicas holding the most leading blocks of `block_hashes`, deepest first;
        among replicas at one depth, those taken start at a random one: a prefix every replica
        holds is not always offered to the same few."""
        found: list[str] = []
        names = self._names
        for mask, _ in reversed(self._levels(block_hashes, self._everyone)):
            need = limit - len(found)
            if mask.bit_count() > need:
                # Rotate the mask by a random number of bits, then take its lowest ones.
                width = mask.bit_length()
                turn = rng.randrange(width)
                mask = (mask >> turn) | ((mask & ((1 << turn) - 1)) << (width - turn))
            else:
                turn = width = 0
            while mask and need:
                low = mask & -mask
                mask ^= low
                bit = low.bit_length() - 1
                found.append(names[(bit + turn) % width if width else bit])
                need -= 1
            if not need:
                break
        return found

    def _levels(
        self, block_hashes: Sequence[int], want: int, also: dict[int, int] | None = None
    ) -> list[tuple[int, int]]:
        """(mask, depth) for each depth > 0 at which some replicas of `want` stop matching, the mask
        holding those replicas, shallowest first. `also`: another tier's masks, a block held there
        counting as held."""
        if not want or not block_hashes:
            return []
        if self.prefix_closed and also is None:
            return self._bisect(block_hashes, want)
        held = map(self._confirmed.get, block_hashes, repeat(0))
        if also is not None:
            held = map(or_, held, map(also.get, block_hashes, repeat(0)))
        if self._speculative:
            self._expire(self._clock())
            held = map(or_, held, map(self._speculative.get, block_hashes, repeat(0)))
        # alive[k] is the mask of the replicas holding the first k blocks. The cumulative AND runs
        # in C and stops, lazily, at the first block no replica holds: no Python code per block.
        alive = list(takewhile(bool, accumulate(held, and_, initial=want)))
        # Masks only shrink along the walk, so equal ones are contiguous: one step per change.
        changes = iter(dict.fromkeys(alive))
        before = next(changes)
        at = 0
        levels = []
        for mask in changes:
            at = alive.index(mask, at)
            if at > 1:
                levels.append((before & ~mask, at - 1))
            before = mask
        if len(alive) > 1:
            levels.append((before, len(alive) - 1))
        return levels

    def _bisect(self, block_hashes: Sequence[int], want: int) -> list[tuple[int, int]]:
        """`_levels` for a prefix-closed index: the masks of `want` along the prompt only shrink, so
        each run of equal masks is found by galloping to a block whose mask differs, then bisecting.
        Lookups: about 2 log2(run length) per change of mask, against one per block for the walk."""
        get = self._confirmed.get
        n = len(block_hashes)
        levels = []
        start, mask = 0, get(block_hashes[0], 0) & want
        while mask:
            # The masks of blocks start..last equal `mask`; that of block `end` (0 past the end) does not.
            last, step = start, 1
            while True:
                end = min(last + step, n)
                after = get(block_hashes[end], 0) & want if end < n else 0
                if after != mask:
                    break
                last, step = end, step * 2
            while end - last > 1:
                mid = (last + end) // 2
                seen = get(block_hashes[mid], 0) & want
                if seen == mask:
                    last = mid
                else:
                    end, after = mid, seen
            levels.append((mask & ~after, last + 1))
            start, mask = end, after
        return levels

    def holds(self, replica: str, block_hash: int) -> bool:
        return bool(self.match([block_hash], [replica])[replica])

    def snapshot(self, replica: str) -> list[int]:
        """The replica's live entries, least recently used first."""
        state = self._replicas.get(replica)
        if state is None:
            return []
        self._expire(self._clock())
        return list(state.lru)

    def entries(self) -> int:
        """Blocks held over all replicas (a block two replicas hold counts twice): the index's size."""
        return sum(len(state.lru) for state in self._replicas.values())

    def stats(self) -> dict[str, object]:
        self._expire(self._clock())
        per_replica: dict[str, dict[str, int]] = {}
        for name, state in self._replicas.items():
            per_replica[name] = {
                "blocks": len(state.lru),
                "speculative": len(state.speculative),
                "capacity": state.capacity,
            }
            if self.lower is not None and (cpu := self.lower._replicas.get(name)) is not None:
                per_replica[name] |= {"cpu_blocks": len(cpu.lru), "cpu_capacity": cpu.capacity}
        return {
            "replicas": per_replica,
            "distinct_blocks": len(self._confirmed.keys() | self._speculative.keys()),
        }
