"""KV cache events over ZMQ PUB in vLLM's wire format (pyzmq and msgpack are the optional `kvevents` extra).

Each engine step's events go out as one multipart message `[topic, seq (8-byte big-endian), payload]`, the
payload `msgpack([ts, [event, ...], dp_rank])` with events as arrays like vLLM's tagged msgspec structs:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. A replica with a CPU tier
(gateway.sim.cpu_tier) adds the offloading connector's placeholder events, medium "CPU", after the
GPU ones of the same step.

The socket follows vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py, as of 0.26): it BINDS only
an endpoint that holds `*` or `::` or is `ipc://` / `inproc://`, and CONNECTS to any other (a
subscriber must then bind there). Defaults are vLLM's `KVEventsConfig` ones: endpoint `tcp://*:5557`,
topic "" (SGLang's publisher, sglang/srt/disaggregation/kv_events.py, behaves the same). A replica with
index i > 0 (`--replicas`) offsets a tcp port by i as vLLM does per data-parallel rank; an ipc or
inproc path gets `_dp<i>` appended (vLLM refuses ipc there: a simulator-only extension).
"""

from __future__ import annotations

import time
from typing import Any, cast

from gateway.sim.cpu_tier import MEDIUM_CPU
from gateway.sim.kv_cache import BlockEvent

MEDIUM = "GPU"
DEFAULT_ENDPOINT = "tcp://*:5557"
DEFAULT_TOPIC = ""


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


def encode_events(events: list[BlockEvent], block_size: int) -> list[list[Any]]:
    out: list[list[Any]] = []
    for kind, payload in events:
        if kind == "stored":
            hashes, parent, tokens = cast("tuple[list[int], int | None, list[int]]", payload)
            out.append(["BlockStored", hashes, parent, tokens, block_size, None, MEDIUM])
        elif kind == "removed":
            out.append(["BlockRemoved", payload, MEDIUM])
        elif kind == "cpu_stored":
            out.append(["BlockStored", [payload], None, [], 0, None, MEDIUM_CPU])
        elif kind == "cpu_removed":
            out.append(["BlockRemoved", payload, MEDIUM_CPU])
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
        self._seq = 0
        self._noblock = zmq.NOBLOCK

    @classmethod
    def from_config(cls, cfg: dict[str, Any], block_size: int, index: int = 0) -> KVEventPublisher:
        """The publisher `--kv-events-config` asks for, for replica `index` of the process."""
        endpoint = offset_endpoint(str(cfg.get("endpoint") or DEFAULT_ENDPOINT), index)
        topic = cfg.get("topic")
        return cls(endpoint, DEFAULT_TOPIC if topic is None else str(topic), block_size, index)

    def publish(self, events: list[BlockEvent]) -> None:
        if not events:
            return
        payload = self._packb([time.time(), encode_events(events, self._block_size), self._dp_rank])
        self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], flags=self._noblock)
        self._seq += 1

    def close(self) -> None:
        self._sock.close(0)
