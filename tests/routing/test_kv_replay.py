"""Missed KV event batches are asked for on the publisher's replay socket (vLLM's framing, over real
ZMQ sockets): after a gap, a reordering, a late join, a reconnect and a restart the index holds what
the engine holds; when the batches cannot be had (no replay socket, a silent, endless or foreign
answer, a trimmed buffer) the replica's entries are forgotten, never left stale."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.routing.kv_events import KVEventIndexer, KVEventSubscriber, TokenBlockHasher
from gateway.routing.kv_replay import END_SEQ, ReplayBounds, ReplayError, fetch_replay
from gateway.routing.prefix_index import PrefixIndex
from tests.conftest import free_port, wait_until

BS = 4
TOKENS = list(range(100, 124))  # six full blocks
TOPIC = b"kv-events"
QUERY = TokenBlockHasher(BS, "m").hashes(TOKENS)


def block(i: int) -> list[Any]:
    """The event storing block i of TOKENS, chained to block i-1 (engine hashes 1, 2, ...)."""
    return ["BlockStored", [i + 1], i or None, TOKENS[i * BS : (i + 1) * BS], BS, None, "GPU"]


class Engine:
    """An engine's publisher: PUB for live batches, a ROUTER for replays as vLLM 0.26 answers them
    (`[b"", topic, seq, payload]`, then `[b"", b"", END, b""]`), or as told to misbehave."""

    def __init__(self, replay: str | None = "ok") -> None:
        ctx = zmq.asyncio.Context.instance()
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.pub: Any = None
        assert self.bind()
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.mode = replay
        self.requests: list[int] = []
        self.router: Any = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
            self._task = asyncio.get_running_loop().create_task(self._serve())

    def bind(self) -> bool:
        """Bind the PUB socket; False while the port is still held by the one closed before (ZMQ
        closes sockets in its own thread)."""
        sock = zmq.asyncio.Context.instance().socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError:
            sock.close(0)
            return False
        self.pub = sock
        return True

    def unbind(self) -> None:
        self.pub.close(0)
        self.pub = None

    def restart(self) -> None:
        """A new engine process: its numbers start at 0 and its buffer is empty."""
        self.buffer, self.seq = [], 0

    async def send(self, events: list[Any], live: bool = True) -> int:
        """Publish one batch (kept for replay); `live=False`: kept but lost on the way."""
        seq, self.seq = self.seq, self.seq + 1
        payload = msgpack.packb([time.time(), events, 0])
        self.buffer.append((seq, payload))
        if live and self.pub is not None:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    async def resend(self, seq: int) -> None:
        """Publish a kept batch again, late (a reordering)."""
        payload = dict(self.buffer)[seq]
        await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            if self.mode == "silent":
                continue
            if self.mode == "endless":
                for seq in range(first, first + 100_000):
                    await self.router.send_multipart([client, b"", TOPIC, seq.to_bytes(8, "big"), b"\x90"])
                continue
            if self.mode == "garbage":
                await self.router.send_multipart([client, b"", b"not", b"replay"])
                continue
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([client, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.router is not None:
            self.router.close(0)
        if self.pub is not None:
            self.pub.close(0)


def held(index: PrefixIndex) -> int:
    return index.match(QUERY, ["r1"])["r1"]


@contextlib.asynccontextmanager
async def following(
    engine: Engine, bounds: ReplayBounds | None = None
) -> AsyncIterator[tuple[KVEventSubscriber, PrefixIndex]]:
    index = PrefixIndex()
    indexer = KVEventIndexer(index, TokenBlockHasher(BS, "m"))
    bounds = bounds or ReplayBounds(timeout_s=2)
    sub = KVEventSubscriber(engine.endpoint, "r1", indexer, "kv-events", engine.replay_endpoint, bounds)
    sub.start()
    try:
        yield sub, index
    finally:
        sub.close()


async def joined(engine: Engine, sub: KVEventSubscriber) -> None:
    """Empty batches until the SUB has joined (ZMQ drops what a PUB sends before)."""

    async def probe() -> bool:
        if sub.stats.batches:
            return True
        await engine.send([])
        return False

    await wait_until(probe, timeout=10, what="a first batch")


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    yield e
    e.close()


async def test_a_lost_batch_is_replayed(engine: Engine) -> None:
    async with following(engine) as (sub, index):
        await joined(engine, sub)
        await engine.send([block(0)])
        await engine.send([block(1)], live=False)  # lost on the way
        await engine.send([block(2)])
        await wait_until(lambda: held(index) == 3, timeout=10, what="three blocks, the lost one replayed")
        st = sub.stats
        assert (st.gaps, st.resets) == (1, 0) and st.replays >= 1 and st.replayed >= 1
        assert engine.requests[-1] == st.last_seq - 2  # asked from the last batch it had applied


async def test_reordered_batches_are_applied_in_order_and_the_late_one_ignored(engine: Engine) -> None:
    async with following(engine) as (sub, index):
        await joined(engine, sub)
        await engine.send([block(0)])
        late = await engine.send([block(1)], live=False)
        await engine.send([["BlockRemoved", [2], "GPU"], block(1)])  # removes and stores block 1 again
        await wait_until(lambda: sub.stats.last_seq == late + 1, timeout=10, what="the batch after the gap")
        # It arrives after its successor: it must not undo what came after it.
        await engine.resend(late)
        await wait_until(lambda: sub.stats.stale == 1, timeout=10, what="the late batch")
        assert held(index) == 2 and sub.stats.resets == 0


async def test_a_subscriber_that_joins_late_asks_for_what_came_before(engine: Engine) -> None:
    for i in range(3):
        await engine.send([block(i)], live=False)  # published before anyone subscribed
    async with following(engine) as (sub, index):
        await joined(engine, sub)
        await wait_until(lambda: held(index) == 3, timeout=10, what="the earlier blocks, replayed")
        assert engine.requests[0] == 0 and sub.stats.resets == 0


async def test_a_reconnect_asks_for_batches_no_later_number_would_show(engine: Engine) -> None:
    async with following(engine) as (sub, index):
        await joined(engine, sub)
        await engine.send([block(0)])
        await wait_until(lambda: held(index) == 1, timeout=10, what="the first block")
        engine.unbind()  # the link drops; the engine goes on storing
        await engine.send([block(1)])
        await engine.send([block(2)])
        await wait_until(engine.bind, timeout=10, what="the port, released")
        # Nothing is published after the reconnect: only the reconnect can tell.
        await wait_until(lambda: held(index) == 3, timeout=20, what="the blocks stored while away")
        assert sub.stats.resets == 0


async def test_an_engine_that_restarted_unseen_is_forgotten_and_replayed_from_zero(engine: Engine) -> None:
    async with following(engine) as (sub, index):
        await joined(engine, sub)
        for i in range(4):
            await engine.send([block(i)])
        await wait_until(lambda: held(index) == 4, timeout=10, what="four blocks")
        engine.restart()
        await engine.send([block(0)], live=False)
        await engine.send([], live=False)
        await engine.send([], live=False)
        await engine.send([block(1)])  # number 3: below what was applied, from a newer batch
        await wait_until(lambda: sub.stats.restarts == 1, timeout=10, what="the restart")
        await wait_until(lambda: held(index) == 2, timeout=10, what="the new engine's two blocks")
        assert 0 in engine.requests


async def test_lost_batches_without_a_replay_socket_forget_the_replica() -> None:
    engine = Engine(replay=None)
    try:
        async with following(engine) as (sub, index):
            await joined(engine, sub)
            await engine.send([block(0), block(1)])
            await wait_until(lambda: held(index) == 2, timeout=10, what="two blocks")
            await engine.send([["BlockRemoved", [1], "GPU"]], live=False)  # a removal is lost
            await engine.send([["BlockStored", [9], None, [7, 7, 7, 7], BS, None, "GPU"]])
            await wait_until(lambda: sub.stats.resets == 1, timeout=10, what="the reset")
            assert held(index) == 0  # not the two blocks the engine no longer holds
            assert index.match(TokenBlockHasher(BS, "m").hashes([7, 7, 7, 7]), ["r1"])["r1"] == 1
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["silent", "endless", "garbage"])
async def test_a_replay_socket_that_misbehaves_costs_the_replicas_entries_not_the_stream(mode: str) -> None:
    engine = Engine(replay="ok")
    try:
        async with following(engine, ReplayBounds(timeout_s=1, max_batches=1000)) as (sub, index):
            await joined(engine, sub)
            await engine.send([block(0)])
            await wait_until(lambda: held(index) == 1, timeout=10, what="the first block")
            engine.mode = mode
            await engine.send([block(1)], live=False)
            await engine.send([block(2)])
            await wait_until(lambda: sub.stats.resets == 1, timeout=15, what="the failed replay")
            assert held(index) == 0
            engine.mode = "ok"
            await engine.send([block(0)])  # the stream goes on after it
            await wait_until(lambda: held(index) == 1, timeout=10, what="a block after the failure")
    finally:
        engine.close()


async def test_a_trimmed_replay_buffer_forgets_then_applies_what_it_kept(engine: Engine) -> None:
    async with following(engine) as (sub, index):
        await joined(engine, sub)
        await engine.send([block(0)])
        await wait_until(lambda: held(index) == 1, timeout=10, what="the first block")
        gone = await engine.send([["BlockRemoved", [1], "GPU"]], live=False)
        engine.buffer = [b for b in engine.buffer if b[0] > gone]  # the engine kept no more than that
        await engine.send([["BlockStored", [9], None, [7, 7, 7, 7], BS, None, "GPU"]])
        await wait_until(lambda: sub.stats.resets == 1, timeout=10, what="the reset")
        assert held(index) == 0
        assert index.match(TokenBlockHasher(BS, "m").hashes([7, 7, 7, 7]), ["r1"])["r1"] == 1


async def test_fetch_replay_reads_both_framings_and_refuses_disorder() -> None:
    ctx = zmq.asyncio.Context.instance()
    router: Any = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    answers = [
        # vLLM before 0.26 and SGLang: no topic frame.
        [[b"", (4).to_bytes(8, "big"), b"a"], [b"", (5).to_bytes(8, "big"), b"b"], [b"", END_SEQ, b""]],
        [[b"", (5).to_bytes(8, "big"), b"b"], [b"", (4).to_bytes(8, "big"), b"a"], [b"", END_SEQ, b""]],
    ]

    async def serve() -> None:
        for answer in answers:
            client, _, _ = await router.recv_multipart()
            for frames in answer:
                await router.send_multipart([client, *frames])

    task = asyncio.get_running_loop().create_task(serve())
    try:
        assert await fetch_replay(endpoint, 4) == [(4, b"a"), (5, b"b")]
        with pytest.raises(ReplayError, match="not oldest first"):
            await fetch_replay(endpoint, 4)
    finally:
        task.cancel()
        router.close(0)
