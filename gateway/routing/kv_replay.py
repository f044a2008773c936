"""Ask an engine's KV event publisher for the batches a subscriber missed (its replay socket).

vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py) keeps its last `buffer_steps` batches
(10,000 by default) when its KV events config names a `replay_endpoint`, where it binds a ROUTER.
A client (a DEALER) sends `[b"", first_seq (8 bytes big-endian)]`; the publisher answers one
message per kept batch whose number is at least that, oldest first, and then an end marker whose
number is -1 (8 bytes, signed) and whose payload is empty. vLLM 0.26 repeats the topic frame in
each answer (`[b"", topic, seq, payload]`, end `[b"", b"", END, b""]`); earlier vLLM and SGLang
send `[b"", seq, payload]` (end `[b"", END, b""]`). Both are read: the last two frames are the
number and the payload.

The publisher is a peer like any other: every fetch has a deadline, a number of batches and a
number of bytes it will read (`ReplayBounds`), and each message a size limit (ZMQ's
MAXMSGSIZE drops the connection of a peer that sends more). A fetch that stops early for any
reason gives nothing back (the caller then clears the replica's entries), and its socket is
closed: an answer still in flight must not be read as the answer to the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_MESSAGE_BYTES = 16 << 20  # one batch of one engine step: far below this


@dataclass(frozen=True, slots=True)
class ReplayBounds:
    timeout_s: float = 5.0  # for the whole answer
    max_batches: int = 20_000  # twice vLLM's default buffer_steps
    max_bytes: int = 256 << 20


class ReplayError(Exception):
    """The replay could not be had: no answer in time, past a bound, or not replay framing."""


async def fetch_replay(
    endpoint: str, first_seq: int, bounds: ReplayBounds | None = None
) -> list[tuple[int, bytes]]:
    """The kept batches numbered `first_seq` or later, oldest first, as (seq, payload)."""
    import zmq
    import zmq.asyncio

    bounds = bounds or ReplayBounds()
    sock: Any = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", first_seq.to_bytes(8, "big")])
        return await asyncio.wait_for(_read_answer(sock, bounds), bounds.timeout_s)
    except TimeoutError:
        raise ReplayError(f"no complete answer within {bounds.timeout_s:g} s") from None
    except zmq.ZMQError as exc:
        raise ReplayError(str(exc)) from None
    finally:
        sock.close(0)


async def _read_answer(sock: Any, bounds: ReplayBounds) -> list[tuple[int, bytes]]:
    batches: list[tuple[int, bytes]] = []
    size = 0
    last = -1
    started = time.monotonic()
    while True:
        frames = await sock.recv_multipart()
        if len(frames) < 3 or frames[0] != b"" or len(frames[-2]) != 8:
            raise ReplayError(f"not a replay answer ({len(frames)} frames)")
        seq_raw, payload = frames[-2], frames[-1]
        if seq_raw == END_SEQ:
            log.debug("replay: %d batches in %.3f s", len(batches), time.monotonic() - started)
            return batches
        seq = int.from_bytes(seq_raw, "big")
        if seq <= last:
            raise ReplayError(f"batch {seq} after {last}: not oldest first")
        last = seq
        size += len(payload)
        batches.append((seq, payload))
        if len(batches) > bounds.max_batches or size > bounds.max_bytes:
            raise ReplayError(
                f"more than {bounds.max_batches} batches or {bounds.max_bytes} bytes: stopped reading"
            )
