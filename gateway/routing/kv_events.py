"""Precise prefix mode: learn what each replica really caches from the engine's KV events.

vLLM (and the bundled simulator) publish KV cache events over ZMQ PUB as multipart messages
`[topic, seq (8-byte big-endian), msgpack([ts, events, dp_rank])]`. An event is a msgspec tagged
struct, encoded as an array whose first element is the tag (`["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, ...]`, `["BlockRemoved", block_hashes,
medium]`, `["AllBlocksCleared"]`; trailing defaults may be omitted) or, from other encoders, as a
map with a `type` key. Both are accepted.

The gateway cannot recompute the engine's own block hashes (vLLM's default is sha256 over CBOR of
parent hash, token ids and extra keys; other engines differ), so, as llm-d does, it re-hashes each
stored block's `token_ids` with its own chain (`TokenBlockHasher`: xxh64 over the ids, seeded by
the parent) and keeps, per replica, a map from the engine's hash to its own. Parents are resolved
through that map, removals translated with it. The routing side hashes a prompt's token ids with
the same `TokenBlockHasher` and asks a `PrefixIndex` fed by `KVEventIndexer` (a separate index
from the character-block one: the hash spaces differ) how many leading token blocks each replica
holds, recording its own decisions there as speculative entries until the events confirm them.

Limitations: the prompt's token ids must be those the engine computes (same tokenizer and chat
template), or nothing will match; vLLM's events do not carry `cache_salt`, so a salted prompt's
blocks are indexed as unsalted ones; blocks whose parent was never seen (events lost before the
subscriber joined) cannot be chained and are skipped until the engine stores them again; LoRA
blocks are chained from a root seeded by `lora_id`.

Media: blocks on the GPU (`medium` unset or "GPU") go to the index itself, blocks offloaded to CPU
memory (`medium` "CPU", vLLM's OffloadingConnector) to its lower tier (`PrefixIndex.lower`), and a
removal applies to its own medium only: a block the GPU evicted stays matchable on CPU. vLLM 0.26
publishes CPU stores as placeholders unless `kv_connector_extra_config.self_describing_kv_events` is
set: one event per offloaded chunk (one GPU block by default) naming only the chunk's last block hash,
with no parent, no tokens and `block_size` 0. That hash is the one the block's GPU event carried, so
it is translated through the same map, which keeps an engine hash while either tier holds its block.
Self-describing CPU events carry tokens and parents and are chained like GPU ones. Other media (files,
object stores) are counted and ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from gateway.prompt.prefix_hash import chain_seed
from gateway.routing.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

_xxh64 = xxhash.xxh64_intdigest
# Field order of vLLM's array-encoded structs, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")
_GPU_MEDIA = (None, "GPU", "gpu", "cuda", "CUDA")
_CPU_MEDIA = ("CPU", "cpu")


class TokenBlockHasher:
    """Chained hashes of full blocks of token ids (engine block_size), in the gateway's own chain."""

    def __init__(self, block_size: int, model: str) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.model = model
        self._roots: dict[int | None, int] = {}

    def root(self, lora_id: int | None = None) -> int:
        seed = self._roots.get(lora_id)
        if seed is None:
            key = self.model if lora_id is None else f"{self.model}\x00lora:{lora_id}"
            seed = self._roots[lora_id] = chain_seed(key, None)
        return seed

    @staticmethod
    def chain(parent: int, tokens: Sequence[int]) -> int:
        return _xxh64(array("q", tokens).tobytes(), parent)

    def hashes(self, token_ids: Sequence[int], lora_id: int | None = None) -> list[int]:
        bs = self.block_size
        h = self.root(lora_id)
        out: list[int] = []
        ids = array("q", token_ids).tobytes()  # one conversion, then 8-byte slices per block
        step = bs * 8
        for start in range(0, (len(token_ids) // bs) * step, step):
            h = _xxh64(ids[start : start + step], h)
            out.append(h)
        return out


@dataclass(slots=True)
class IndexerStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0  # stored blocks whose parent was unknown
    cpu_stored: int = 0
    cpu_removed: int = 0
    cpu_unmapped: int = 0  # CPU placeholders naming a block never seen on the GPU
    foreign_media: int = 0
    block_size_mismatch: int = 0
    malformed: int = 0


def _fields(event: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(event, Mapping):
        return {n: event.get(n) for n in names}
    values = list(event[1:]) + [None] * len(names)
    return dict(zip(names, values, strict=False))


def event_kind(event: Any) -> str | None:
    if isinstance(event, Mapping):
        kind = event.get("type", event.get("tag"))
    elif isinstance(event, (list, tuple)) and event:
        kind = event[0]
    else:
        return None
    if isinstance(kind, bytes):
        kind = kind.decode(errors="replace")
    return kind if isinstance(kind, str) else None


class KVEventIndexer:
    """Applies engine KV events to a PrefixIndex keyed by `TokenBlockHasher` hashes."""

    def __init__(
        self, index: PrefixIndex, hasher: TokenBlockHasher, max_mapped_blocks: int = 1 << 20
    ) -> None:
        self.index = index
        self.hasher = hasher
        self.max_mapped_blocks = max_mapped_blocks
        # Per replica: engine block hash -> our hash, oldest first (bounded in case removals are lost).
        self._ours: dict[str, OrderedDict[Any, int]] = {}
        # Per replica: engine hashes of the blocks its CPU tier holds (their map entries must outlive
        # a GPU removal).
        self._on_cpu: dict[str, set[Any]] = {}
        self.stats = IndexerStats()

    def apply(self, replica: str, events: Sequence[Any]) -> int:
        """Apply a batch; returns how many of its events were usable (a stream of unusable ones,
        e.g. of another block size, is as good as none)."""
        applied = 0
        for event in events:
            kind = event_kind(event)
            if kind == "BlockStored":
                applied += self._stored(replica, _fields(event, _STORED_FIELDS))
            elif kind == "BlockRemoved":
                applied += self._removed(replica, _fields(event, _REMOVED_FIELDS))
            elif kind == "AllBlocksCleared":
                self.clear(replica)
                applied += 1
            else:
                self.stats.malformed += 1
        return applied

    def clear(self, replica: str) -> None:
        """The engine dropped everything (or restarted): forget its blocks."""
        self.stats.cleared += 1
        self._ours.pop(replica, None)
        self._on_cpu.pop(replica, None)
        self.index.clear_replica(replica)

    def _stored(self, replica: str, f: dict[str, Any]) -> bool:
        hashes, tokens, block_size = f["block_hashes"], f["token_ids"], f["block_size"]
        if isinstance(block_size, list):  # early vLLM: num_toks_per_block
            block_size = block_size[0] if block_size else None
        if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(block_size, int):
            self.stats.malformed += 1
            return False
        cpu = f["medium"] in _CPU_MEDIA
        if not cpu and f["medium"] not in _GPU_MEDIA:
            self.stats.foreign_media += 1
            return True  # a real event, of blocks offloaded elsewhere
        if cpu and not tokens:
            return self._cpu_placeholder(replica, hashes)
        if block_size != self.hasher.block_size:
            self.stats.block_size_mismatch += 1
            return False
        mapping = self._ours.setdefault(replica, OrderedDict())
        parent_engine = f["parent_block_hash"]
        lora_id = f["lora_id"] if isinstance(f["lora_id"], int) else None
        parent = self.hasher.root(lora_id) if parent_engine is None else mapping.get(parent_engine)
        if parent is None:
            self.stats.orphans += len(hashes)
            return True  # its parent's event was lost; later ones can chain again
        ours: list[int] = []
        for i, engine_hash in enumerate(hashes):
            block = tokens[i * block_size : (i + 1) * block_size]
            if len(block) < block_size:
                self.stats.malformed += 1
                break
            parent = self.hasher.chain(parent, block)
            mapping[engine_hash] = parent
            mapping.move_to_end(engine_hash)
            ours.append(parent)
        while len(mapping) > self.max_mapped_blocks:
            mapping.popitem(last=False)
        if cpu:
            self._on_cpu.setdefault(replica, set()).update(hashes[: len(ours)])
            self.stats.cpu_stored += len(ours)
            self._cpu_index().record(replica, ours)
        else:
            self.stats.stored += len(ours)
            self.index.record(replica, ours)
        return True

    def _cpu_index(self) -> PrefixIndex:
        return self.index.add_lower_tier(self.index.default_capacity)

    def _cpu_placeholder(self, replica: str, hashes: list[Any]) -> bool:
        """A CPU store named by engine hashes only: those of blocks seen on the GPU are recorded."""
        mapping: Mapping[Any, int] = self._ours.get(replica, {})
        ours = [h for h in map(mapping.get, hashes) if h is not None]
        self.stats.cpu_unmapped += len(hashes) - len(ours)
        if ours:
            self._on_cpu.setdefault(replica, set()).update(e for e in hashes if e in mapping)
            self.stats.cpu_stored += len(ours)
            self._cpu_index().record(replica, ours)
        return True

    def _removed(self, replica: str, f: dict[str, Any]) -> bool:
        hashes = f["block_hashes"]
        if not isinstance(hashes, list):
            self.stats.malformed += 1
            return False
        cpu = f["medium"] in _CPU_MEDIA
        if not cpu and f["medium"] not in _GPU_MEDIA:
            self.stats.foreign_media += 1
            return True
        mapping = self._ours.get(replica)
        if not mapping:
            return True
        on_cpu = self._on_cpu.get(replica, set())
        ours: list[int] = []
        if cpu:
            lower = self._cpu_index()
            for e in hashes:
                h = mapping.get(e)
                if h is not None:
                    ours.append(h)
                    on_cpu.discard(e)
                    if not self.index.holds(replica, h):  # gone from both tiers now
                        del mapping[e]
            self.stats.cpu_removed += len(ours)
            lower.discard(replica, ours)
            return True
        for e in hashes:
            h = mapping.get(e) if e in on_cpu else mapping.pop(e, None)
            if h is not None:
                ours.append(h)
        self.stats.removed += len(ours)
        self.index.discard(replica, ours)
        return True


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    gaps: int = 0  # sequence numbers skipped (messages lost)
    decode_errors: int = 0
    last_seq: int | None = None
    last_event_at: float | None = None  # time.monotonic() of the last batch with a usable event
    # Set when a request that must make the engine store blocks was routed to the replica, cleared
    # by the next usable event: how long events have been owed.
    awaiting_since: float | None = None


def decode_batch(payload: bytes) -> tuple[float, list[Any], int]:
    """(ts, events, dp_rank) of one msgpack payload; ValueError when it is not an event batch."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(batch, Mapping):
        batch = [batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank", 0)]
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not an event batch")
    dp_rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else 0
    return float(batch[0] or 0.0), batch[1], dp_rank


class KVEventSubscriber:
    """One replica's ZMQ SUB socket feeding a KVEventIndexer, as a task on the running event loop."""

    def __init__(self, endpoint: str, replica: str, indexer: KVEventIndexer, topic: str = "") -> None:
        self.endpoint = endpoint
        self.replica = replica
        self.indexer = indexer
        self.topic = topic
        self.stats = SubscriberStats()
        self._task: asyncio.Task[None] | None = None
        self._socket: Any = None

    def start(self) -> None:
        """Connect and start consuming on the running event loop; a second call does nothing."""
        if self._task is not None:
            return
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._socket.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events:{self.replica}")

    def close(self) -> None:
        """Stop consuming. Synchronous, so a replica can be dropped from any callback."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def handle(self, frames: Sequence[bytes]) -> None:
        """Apply one multipart message: [topic, seq, payload] (a bare [seq, payload] is accepted)."""
        if len(frames) < 2:
            self.stats.decode_errors += 1
            return
        seq_raw, payload = frames[-2], frames[-1]
        try:
            _, events, _ = decode_batch(payload)
        except ValueError:
            self.stats.decode_errors += 1
            return
        seq = int.from_bytes(seq_raw, "big") if len(seq_raw) == 8 else None
        if seq is not None:
            last = self.stats.last_seq
            if last is not None and seq > last + 1:
                self.stats.gaps += seq - last - 1
            elif last is not None and seq <= last:
                # The publisher restarted (sequence reset): its cache restarted empty too.
                self.indexer.clear(self.replica)
            self.stats.last_seq = seq
        self.stats.batches += 1
        if self.indexer.apply(self.replica, events):
            self.stats.last_event_at = time.monotonic()
            self.stats.awaiting_since = None

    async def _run(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                self.handle(frames)
            except Exception:  # one bad batch must not end the subscription
                self.stats.decode_errors += 1
                log.exception("kv events from %s: batch could not be applied", self.replica)
