"""The KV block pool of one replica: reference-counted blocks, a prefix cache of chained block hashes, LRU
eviction of unreferenced cached blocks, and the block events vLLM publishes.

A block's hash chains its parent's hash with its token ids (xxh3-64, so hashes agree across processes); the
first block also takes the request's `cache_salt` and LoRA adapter (vLLM adds the adapter's name to every
block's hash as an extra key: blocks of different adapters never match). A hash is registered only once the
block's prefill has finished, so a request that arrives while the same prefix is still being computed does
not hit it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

# (kind, payload): ("stored", (hashes, parent_hash, token_ids)) | ("removed", hashes) | ("cleared", None)
BlockEvent = tuple[str, object]


def root_hash(salt: str | None = None, lora: str | None = None) -> int:
    """The parent of a chain's first block."""
    if lora:
        return xxhash.xxh3_64_intdigest(f"{salt or ''}\x00lora:{lora}".encode())
    return xxhash.xxh3_64_intdigest(salt.encode()) if salt else 0


def chain_hash(parent: int, block_tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("q", block_tokens).tobytes(), seed=parent)


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, lora: str | None = None
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`."""
    out: list[int] = []
    parent = root_hash(salt, lora)
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-used or uncached blocks
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block id -> hash, for registered blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, oldest first
        self.num_used = 0  # blocks with refs > 0
        self.events: list[BlockEvent] = []
        self.record_events = False

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never used, or cached but unreferenced (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (no reference taken)."""
        if not self.enable_caching:
            return []
        out: list[int] = []
        cached = self._cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def evictable_among(self, blocks: Sequence[int]) -> int:
        return sum(1 for b in blocks if self._refs[b] == 0)

    # ---- mutations -----------------------------------------------------------------------------
    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks."""
        refs = self._refs
        for b in blocks:
            if refs[b] == 0:
                self._lru.pop(b, None)
                self.num_used += 1
            refs[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                self._unregister(b)
            out.append(b)
        for b in out:
            self._refs[b] = 1
        self.num_used += n
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; the tail of a sequence goes first so it is evicted first."""
        refs = self._refs
        for b in reversed(blocks):
            refs[b] -= 1
            if refs[b] == 0:
                self.num_used -= 1
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, h: int, parent: int | None, token_ids: Sequence[int]) -> None:
        """Publish a block whose prefill finished under hash `h` (a duplicate of a cached hash is kept
        private: it is freed as a plain block)."""
        if not self.enable_caching or h in self._cached or block in self._hash_of:
            return
        self._cached[h] = block
        self._hash_of[block] = h
        if self.record_events:
            last = self.events[-1] if self.events else None
            if last is not None and last[0] == "stored" and last[1][0][-1] == parent:  # type: ignore[index]
                # The next block of the same chain: one event for the run, as vLLM sends.
                last[1][0].append(h)  # type: ignore[index]
                last[1][2].extend(token_ids)  # type: ignore[index]
            else:
                self.events.append(("stored", ([h], parent, list(token_ids))))

    def _unregister(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._cached[h]
        if self.record_events:
            if self.events and self.events[-1][0] == "removed":
                self.events[-1][1].append(h)  # type: ignore[attr-defined]
            else:
                self.events.append(("removed", [h]))

    def reset_cache(self) -> bool:
        """Forget every unreferenced cached block (vLLM's reset_prefix_cache); False if some are in use."""
        if self.num_used:
            return False
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._cached[h]
            self._free.append(b)
        if self.record_events:
            self.events.append(("cleared", None))
        return True

    def take_events(self) -> list[BlockEvent]:
        ev, self.events = self.events, []
        return ev
