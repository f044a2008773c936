"""The CPU tier of one replica's KV cache: vLLM's OffloadingConnector with its native CPU backend
(`--kv-offloading-backend native --kv-offloading-size <GiB>`), as vLLM 0.26.0 keeps it.

What it copies from vLLM 0.26.0 (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py,
vllm/v1/kv_offload/cpu/{spec,manager}.py, .../cpu/policies/lru.py; docs/kv-tiers.md has the details):
- Capacity: `cpu_bytes_to_use = size * 2**30` over the bytes of one KV block of every worker
  (`CPUOffloadingSpec`; one GPU block per chunk, `blocks_per_chunk` 1), evicted LRU.
- The tier holds what the GPU holds, and more: every lookup (`get_num_new_matched_tokens`, each time
  the scheduler considers a waiting request) touches ALL of the request's prompt blocks that are on
  CPU, its GPU hit included (`_touch`, in reverse, so that its first block ends up most recent); and
  a request that loads nothing from CPU stores every prompt block that is not on CPU, its GPU-hit
  blocks included (`next_stored_chunk_idx` stays 0 unless `update_state_after_alloc` ran for a load).
  Under one reference stream an LRU of N blocks holds what one of fewer blocks holds, so the CPU tier
  adds to the GPU's reach only its size beyond the GPU's, not its whole size.
- Stores: one job per request per step, for the prompt blocks the step computed (`_build_store_jobs`,
  `offload_prompt_only` true: generated blocks are not offloaded); blocks already on CPU are skipped;
  the job's blocks cannot be evicted to make room for it (`protected`); a job that does not fit
  stores nothing (`prepare_store` returns None). A job's blocks become evictable together, in the
  order of a Python set of their keys (`TransferJobStatus.keys`): the least recent end of a block set
  that nothing has touched since its store is a scattering of its blocks, not its tail, so a
  partially evicted prefix matches only up to its first hole. The simulator orders them by hash value,
  a deterministic stand-in for the set's order.
- Loads: a request's prefix hit continues past its GPU hit on CPU (`_maximal_prefix_lookup`); those
  blocks are copied to the GPU and then count as computed; once loaded they become the most recent,
  again in set order (`complete_load`). vLLM loads asynchronously while the request waits; here the
  step that admits the request takes the copy time (tokens x KV bytes per token / host link bandwidth).
- Events: without `self_describing_kv_events` (off by default) the connector publishes placeholder
  payloads, `BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=0,
  medium="CPU")` per stored block and one `BlockRemoved([h...], medium="CPU")` per store job that
  evicted, after the scheduler's GPU events of the same step. `h` is the block's own hash, the one
  its GPU events carry.
- Metrics: vLLM's `vllm:kv_offload_{load,store}_bytes` counters and `_size` histograms (one
  observation per transfer job), and `vllm:kv_offload_cpu_cache_usage_perc`, which in vLLM is the
  share of CPU blocks pinned by transfers in flight (ref_cnt != 0), not the tier's occupancy: 0 here,
  where a step's transfers end with the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.sim.kv_cache import BlockEvent
from gateway.sim.metrics import Histogram

MEDIUM_CPU = "CPU"
# vLLM's TRANSFER_SIZE_BUCKETS (offloading/metrics.py), bytes per transfer job.
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


class CpuTier:
    def __init__(self, num_blocks: int, load_s_per_token: float, block_size: int, block_bytes: int) -> None:
        if num_blocks < 1:
            raise ValueError("the CPU tier holds no block: raise --kv-offloading-size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.load_s_per_token = load_s_per_token
        self._lru: OrderedDict[int, None] = OrderedDict()  # block hash, least recent first
        self.events: list[BlockEvent] = []
        self.record_events = False
        self.stores = 0  # blocks copied here
        self.loads = 0  # blocks copied back to the GPU
        self.allocation_failures = 0
        self.load_size = Histogram(TRANSFER_SIZE_BUCKETS)
        self.store_size = Histogram(TRANSFER_SIZE_BUCKETS)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def lookup(self, hashes: Sequence[int], start: int, stop: int) -> int:
        """How many of `hashes[start:stop]` (the blocks past a GPU hit) are on CPU, leading ones."""
        lru = self._lru
        n = 0
        for h in hashes[start:stop]:
            if h not in lru:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        """A lookup's touch of the request's blocks: the first one ends up the most recent."""
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)

    def load(self, hashes: Sequence[int]) -> float:
        """Copy these blocks to the GPU; returns the seconds it takes."""
        lru = self._lru
        for h in sorted(hashes):  # evictable again once loaded, in the job's set order
            lru.move_to_end(h)
        self.loads += len(hashes)
        self.load_size.observe(len(hashes) * self.block_bytes)
        return len(hashes) * self.block_size * self.load_s_per_token

    def store(self, hashes: Sequence[int]) -> None:
        """One store job: the prompt blocks a step computed for one request (GPU-hit ones too, for a
        request that loaded nothing). Those not here are copied, evicting the least recent others."""
        lru = self._lru
        new = [h for h in hashes if h not in lru]
        if not new:
            return
        excess = len(lru) + len(new) - self.num_blocks
        if excess > 0:
            protected = set(hashes)
            victims: list[int] = []
            for h in lru:
                if h not in protected:
                    victims.append(h)
                    if len(victims) == excess:
                        break
            if len(victims) < excess:
                self.allocation_failures += 1  # vLLM: "cannot store chunks"; nothing of the job is stored
                return
            for h in victims:
                del lru[h]
            if self.record_events:
                self.events.append(("cpu_removed", victims))
        for h in sorted(new):
            lru[h] = None
        self.stores += len(new)
        self.store_size.observe(len(new) * self.block_bytes)
        if self.record_events:
            self.events += [("cpu_stored", h) for h in sorted(new)]

    def clear(self) -> None:
        """vLLM's `POST /reset_prefix_cache?reset_external=true` (the connector's reset publishes nothing)."""
        self._lru.clear()

    def take_events(self) -> list[BlockEvent]:
        ev, self.events = self.events, []
        return ev
