"""KV cache events over ZMQ PUB in vLLM's wire format (pyzmq and msgpack are the optional `kvevents` extra).

Each engine step's events go out as one multipart message `[topic, seq (8-byte big-endian), payload]`, the
payload `msgpack([ts, [event, ...], dp_rank])`. vLLM 0.26.0's events are msgspec structs tagged but not
array-like (`KVCacheEvent(omit_defaults=True, tag=True)`, vllm/distributed/kv_events.py), so each is a
map: `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
"lora_id", "medium", "lora_name", "group_idx": 0}` (one per step and request's new full blocks,
`BlockPool._build_block_stored_event`), `{"type": "BlockRemoved", "block_hashes": [h], "medium",
"group_idx": 0}` (one per evicted block, `_emit_block_removed_events`), `{"type": "AllBlocksCleared"}`;
fields at their defaults (`extra_keys`, `locality`, ...) are left out, and block hashes are 64-bit
ints (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, default on). A replica with a CPU tier
(gateway.sim.cpu_tier) adds the offloading connector's placeholder events, medium "CPU", after the
GPU ones of the same step. The SGLang flavour (`--api sglang`) keeps SGLang's array-like structs
(sglang/srt/disaggregation/kv_events.py): `["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id]`, `["BlockRemoved", block_hashes]`, `["AllBlocksCleared"]`, in a
batch `[ts, events]`.

The socket follows vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py, as of 0.26): it BINDS only
an endpoint that holds `*` or `::` or is `ipc://` / `inproc://`, and CONNECTS to any other (a
subscriber must then bind there). Defaults are vLLM's `KVEventsConfig` ones: endpoint `tcp://*:5557`,
topic "" (SGLang's publisher, sglang/srt/disaggregation/kv_events.py, behaves the same). A replica with
index i > 0 (`--replicas`) offsets a tcp port by i as vLLM does per data-parallel rank; an ipc or
inproc path gets `_dp<i>` appended (vLLM refuses ipc there: a simulator-only extension).

Replay, as vLLM's: with `replay_endpoint` in the config, a ROUTER socket is BOUND there (whatever the
address holds) and the last `buffer_steps` (10,000) batches are kept. A client (a DEALER, which can
take many replies to one request) sends two frames, `b""` and the first sequence number it wants as
8 bytes big-endian; the ROUTER sees them behind the client's identity, and any other number of frames
is ignored (logged, no answer, as vLLM). It answers one message per kept batch whose number is at
least that, `[b"", topic, seq (8 bytes big-endian), payload]` exactly as published, oldest first, then
the end marker `[b"", b"", (-1).to_bytes(8, "big", signed=True), b""]`. A number older than the
buffer gets what is left (the client sees the gap in the first number replayed); a number not yet
published gets the end marker alone. Sequence numbers start at 0 when the engine (re)starts. SGLang's
publisher (the SGLang flavour) answers the same requests without the topic frame: `[b"", seq,
payload]`, end `[b"", END, b""]`.

Faults (tests, `--fault-kv-*` flags or `POST /sim/kv_events/faults`): a dropped batch takes its
number and enters the replay buffer but is not sent on the PUB socket, as a batch a subscriber
missed; a reordered one is held back and sent right after the next batch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from typing import Any, cast

from gateway.sim.cpu_tier import MEDIUM_CPU
from gateway.sim.kv_cache import BlockEvent

log = logging.getLogger(__name__)

MEDIUM = "GPU"
DEFAULT_ENDPOINT = "tcp://*:5557"
DEFAULT_TOPIC = ""
DEFAULT_BUFFER_STEPS = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds this endpoint (else it connects to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, index: int) -> str:
    """The endpoint of replica `index`: a tcp port moves up by the index, a path gets a suffix."""
    if index == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{index}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():  # a wildcard port: every replica gets its own anyway
        return endpoint
    return f"{base}:{int(port) + index}"


def parse_kv_events_config(raw: str | None) -> dict[str, Any] | None:
    """The `--kv-events-config` JSON when it enables events, else None."""
    if not raw:
        return None
    import json

    cfg = json.loads(raw)
    if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
        return None
    return cfg


def encode_events(events: list[BlockEvent], block_size: int, flavor: str = "vllm") -> list[Any]:
    """A step's events as vLLM 0.26.0 (maps) or SGLang (arrays) encode them."""
    if flavor == "sglang":
        return [_sglang_event(kind, payload, block_size) for kind, payload in events]
    out: list[Any] = []
    for kind, payload in events:
        if kind == "stored":
            hashes, parent, tokens = cast("tuple[list[int], int | None, list[int]]", payload)
            out.append(_stored(hashes, parent, tokens, block_size, MEDIUM))
        elif kind == "removed":  # one event per block, as BlockPool._emit_block_removed_events
            for h in cast("list[int]", payload):
                out.append({"type": "BlockRemoved", "block_hashes": [h], "medium": MEDIUM, "group_idx": 0})
        elif (
            kind == "cpu_stored"
        ):  # the connector's placeholder (OffloadingEventsTracker._placeholder_stored)
            out.append(_stored([cast(int, payload)], None, [], 0, MEDIUM_CPU))
        elif kind == "cpu_removed":
            out.append(
                {"type": "BlockRemoved", "block_hashes": payload, "medium": MEDIUM_CPU, "group_idx": 0}
            )
        else:
            out.append({"type": "AllBlocksCleared"})
    return out


def _stored(
    hashes: list[int], parent: int | None, tokens: list[int], block_size: int, medium: str
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": 0,
    }


def _sglang_event(kind: str, payload: object, block_size: int) -> list[Any]:
    if kind == "stored":
        hashes, parent, tokens = cast("tuple[list[int], int | None, list[int]]", payload)
        return ["BlockStored", hashes, parent, tokens, block_size, None]
    if kind == "removed":
        return ["BlockRemoved", payload]
    return ["AllBlocksCleared"]


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        dp_rank: int = 0,
        replay_endpoint: str | None = None,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        flavor: str = "vllm",
    ) -> None:
        try:
            import msgpack
            import zmq
            import zmq.asyncio
        except ImportError as exc:  # an optional extra: say which one
            raise RuntimeError(
                "--kv-events-config needs pyzmq and msgpack: pip install 'kvgate[kvevents]'"
            ) from exc
        self._packb = msgpack.packb
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.bound = binds(endpoint)
        if self.bound:
            self._sock.bind(endpoint)
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sock.connect(endpoint)  # someone else binds there (vLLM's rule: no `*`, no bind)
            self.endpoint = endpoint
        self._topic = topic.encode()
        self._block_size = block_size
        self._dp_rank = dp_rank
        self._flavor = flavor
        self._seq = 0
        self._noblock = zmq.NOBLOCK
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self.replay_endpoint: str | None = None
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)  # vLLM binds its ROUTER whatever the address
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        # Faults: batches to drop or hold back, by count (deterministic) or at random.
        self.drop_next = 0
        self.reorder_next = 0
        self.drop_rate = 0.0
        self.reorder_rate = 0.0
        self._rng = random.Random(0)
        self._held: list[bytes] | None = None
        self.dropped = 0
        self.reordered = 0

    @classmethod
    def from_config(
        cls, cfg: dict[str, Any], block_size: int, index: int = 0, flavor: str = "vllm"
    ) -> KVEventPublisher:
        """The publisher `--kv-events-config` asks for, for replica `index` of the process."""
        endpoint = offset_endpoint(str(cfg.get("endpoint") or DEFAULT_ENDPOINT), index)
        replay = cfg.get("replay_endpoint")
        topic = cfg.get("topic")
        return cls(
            endpoint,
            DEFAULT_TOPIC if topic is None else str(topic),
            block_size,
            index,
            offset_endpoint(str(replay), index) if replay else None,
            int(cfg.get("buffer_steps") or DEFAULT_BUFFER_STEPS),
            flavor,
        )

    @property
    def next_seq(self) -> int:
        return self._seq

    def set_faults(self, seed: int, drop_rate: float = 0.0, reorder_rate: float = 0.0) -> None:
        self._rng = random.Random(seed)
        self.drop_rate = drop_rate
        self.reorder_rate = reorder_rate

    def publish(self, events: list[BlockEvent]) -> None:
        if not events:
            return
        batch: list[Any] = [time.time(), encode_events(events, self._block_size, self._flavor)]
        if self._flavor == "vllm":
            batch.append(self._dp_rank)
        payload = self._packb(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        frames = [self._topic, seq.to_bytes(8, "big"), payload]
        if self.drop_next > 0 or (self.drop_rate and self._rng.random() < self.drop_rate):
            self.drop_next = max(0, self.drop_next - 1)
            self.dropped += 1
            return
        if self._held is None and (
            self.reorder_next > 0 or (self.reorder_rate and self._rng.random() < self.reorder_rate)
        ):
            self.reorder_next = max(0, self.reorder_next - 1)
            self.reordered += 1
            self._held = frames
            return
        self._sock.send_multipart(frames, flags=self._noblock)
        if self._held is not None:
            held, self._held = self._held, None
            self._sock.send_multipart(held, flags=self._noblock)

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (vLLM's `_service_replay`)."""
        sock = self._replay
        if sock is None:
            return
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            # vLLM repeats the topic frame; SGLang's replay has none (`[b"", seq, payload]`).
            topic = [self._topic] if self._flavor == "vllm" else []
            end = [b""] if self._flavor == "vllm" else []
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart([client, b"", *topic, seq.to_bytes(8, "big"), payload])
            await sock.send_multipart([client, b"", *end, END_SEQ, b""])
            await asyncio.sleep(0)  # one client's replay at a time, the engine's steps between

    def close(self) -> None:
        self._sock.close(0)
        if self._replay is not None:
            self._replay.close(0)
