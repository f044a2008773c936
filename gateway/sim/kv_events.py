"""KV cache events over ZMQ PUB in vLLM's wire format (pyzmq and msgpack are the optional `kvevents` extra).

Each engine step's events go out as one multipart message `[topic, seq (8-byte big-endian), payload]`, the
payload `msgpack([ts, [event, ...], dp_rank])` with events as arrays like vLLM's tagged msgspec structs:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.sim.kv_cache import BlockEvent

MEDIUM = "GPU"


def parse_kv_events_config(raw: str | None) -> dict[str, Any] | None:
    """The `--kv-events-config` JSON when it enables events, else None."""
    if not raw:
        return None
    import json

    cfg = json.loads(raw)
    if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
        return None
    return cfg


def encode_events(events: list[BlockEvent], block_size: int) -> list[list[Any]]:
    out: list[list[Any]] = []
    for kind, payload in events:
        if kind == "stored":
            hashes, parent, tokens = payload  # type: ignore[misc]
            out.append(["BlockStored", hashes, parent, tokens, block_size, None, MEDIUM])
        elif kind == "removed":
            out.append(["BlockRemoved", payload, MEDIUM])
        else:
            out.append(["AllBlocksCleared"])
    return out


class KVEventPublisher:
    def __init__(self, endpoint: str, topic: str, block_size: int, dp_rank: int = 0) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:  # an optional extra: say which one
            raise RuntimeError(
                "--kv-events-config needs pyzmq and msgpack: pip install 'kvgate[kvevents]'"
            ) from exc
        self._packb = msgpack.packb
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._topic = topic.encode()
        self._block_size = block_size
        self._dp_rank = dp_rank
        self._seq = 0
        self._noblock = zmq.NOBLOCK

    def publish(self, events: list[BlockEvent]) -> None:
        if not events:
            return
        payload = self._packb([time.time(), encode_events(events, self._block_size), self._dp_rank])
        self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], flags=self._noblock)
        self._seq += 1

    def close(self) -> None:
        self._sock.close(0)
