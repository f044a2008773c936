"""The CPU tier of one replica's KV cache: vLLM's OffloadingConnector with its native CPU backend
(`--kv-offloading-backend native --kv-offloading-size <GiB>`), as of vLLM 0.26.

What it copies from vLLM (vllm/distributed/kv_transfer/kv_connector/v1/offloading/, vllm/v1/kv_offload/cpu/):
- Write-through: a prompt block is stored to CPU as soon as its KV is computed, whether or not the GPU
  keeps it (`offload_prompt_only` defaults to true: generated blocks are not offloaded). A block already
  on CPU is not stored again. So the CPU tier holds the most recently computed prompt blocks, GPU ones
  included, and a block evicted from the GPU stays loadable from CPU while the CPU LRU keeps it.
- Capacity: `cpu_bytes_to_use = size * 2**30` over the bytes of one KV block (one GPU block per chunk,
  `blocks_per_chunk` defaults to 1); eviction is LRU (`eviction_policy` "lru"), and a lookup touches
  the blocks it hits.
- Loads: a request's prefix hit continues past its GPU hit on CPU (`get_num_new_matched_tokens`);
  those blocks are copied to the GPU and then count as computed. vLLM loads between steps while the
  request waits; here the step that admits the request takes the copy time (tokens x KV bytes per
  token / host link bandwidth): an approximation that charges the batch, not only the request.
- Events: without `self_describing_kv_events` (off by default) the connector publishes placeholder
  payloads, `BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=0,
  medium="CPU")` and `BlockRemoved([h...], medium="CPU")`, after the scheduler's GPU events of the
  same step. `h` is the block's own hash, the one its GPU events carry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.sim.kv_cache import BlockEvent

MEDIUM_CPU = "CPU"


class CpuTier:
    def __init__(self, num_blocks: int, load_s_per_token: float, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the CPU tier holds no block: raise --kv-offloading-size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.load_s_per_token = load_s_per_token
        self._lru: OrderedDict[int, None] = OrderedDict()  # block hash, oldest first
        self.events: list[BlockEvent] = []
        self.record_events = False
        self.stores = 0
        self.loads = 0  # blocks copied back to the GPU

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int], start: int, stop: int) -> int:
        """How many of `hashes[start:stop]` (the blocks past a GPU hit) are on CPU, leading ones;
        they are touched, as vLLM's lookup does."""
        lru = self._lru
        n = 0
        for h in hashes[start:stop]:
            if h not in lru:
                break
            lru.move_to_end(h)
            n += 1
        return n

    def load(self, blocks: int) -> float:
        """Seconds to copy `blocks` blocks to the GPU."""
        self.loads += blocks
        return blocks * self.block_size * self.load_s_per_token

    def store(self, h: int) -> None:
        """A prompt block's KV was computed on the GPU: copy it here (once), evicting the LRU."""
        lru = self._lru
        if h in lru:
            return
        if len(lru) >= self.num_blocks:
            old, _ = lru.popitem(last=False)
            if self.record_events:
                last = self.events[-1] if self.events else None
                if last is not None and last[0] == "cpu_removed":
                    last[1].append(old)  # type: ignore[attr-defined]
                else:
                    self.events.append(("cpu_removed", [old]))
        lru[h] = None
        self.stores += 1
        if self.record_events:
            self.events.append(("cpu_stored", h))

    def clear(self) -> None:
        """vLLM's `POST /reset_prefix_cache?reset_external=true` (the connector's reset publishes nothing)."""
        self._lru.clear()

    def take_events(self) -> list[BlockEvent]:
        ev, self.events = self.events, []
        return ev
