"""Precise mode: vLLM-format KV events over a real ZMQ PUB socket feed the token-block index."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq

from gateway.routing.kv_events import KVEventIndexer, KVEventSubscriber, TokenBlockHasher
from gateway.routing.prefix_index import PrefixIndex
from tests.conftest import wait_until

BS = 4
TOKENS = list(range(100, 120))  # five full blocks


class Publisher:
    """An engine's side of the wire: PUB socket, 8-byte sequence numbers, msgpack batches."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def send(self, events: list[Any], seq: int | None = None, payload: bytes | None = None) -> None:
        if seq is not None:
            self.seq = seq
        body = payload if payload is not None else msgpack.packb([time.time(), events, 0])
        self.sock.send_multipart([b"kv-events", self.seq.to_bytes(8, "big"), body])
        self.seq += 1


@pytest.fixture
async def wired() -> AsyncIterator[tuple[Publisher, KVEventSubscriber, PrefixIndex]]:
    pub = Publisher()
    index = PrefixIndex()
    sub = KVEventSubscriber(pub.endpoint, "r1", KVEventIndexer(index, TokenBlockHasher(BS, "m")), "kv-events")
    sub.start()
    # ZMQ drops what a PUB sends before the SUB has joined: send no-op batches until one arrives.
    await wait_until(lambda: sub.stats.batches or pub.send([]), timeout=10, what="a first batch")
    try:
        yield pub, sub, index
    finally:
        sub.close()
        pub.sock.close(0)


def stored(hashes: list[Any], parent: Any, tokens: list[int], medium: str | None = "GPU") -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, BS, None, medium]


async def test_stored_removed_cleared_over_zmq(
    wired: tuple[Publisher, KVEventSubscriber, PrefixIndex],
) -> None:
    pub, sub, index = wired
    query = TokenBlockHasher(BS, "m").hashes([*TOKENS, 7, 7])
    # The engine stores the first three blocks in one event, then two more chained to the third.
    pub.send([stored([b"e0", b"e1", b"e2"], None, TOKENS[:12])])
    pub.send(
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"e3", b"e4"],
                "parent_block_hash": b"e2",
                "token_ids": TOKENS[12:20],
                "block_size": BS,
            }
        ]
    )
    await wait_until(lambda: index.match(query, ["r1"])["r1"] == 5, timeout=10, what="five stored blocks")

    pub.send([["BlockRemoved", [b"e1"], "GPU"]])
    second_removed = lambda: index.match(query, ["r1"])["r1"] == 1  # noqa: E731
    await wait_until(second_removed, timeout=10, what="removal of the second block")

    pub.send([["AllBlocksCleared"]])
    await wait_until(lambda: index.match(query, ["r1"])["r1"] == 0, timeout=10, what="clear")
    assert sub.indexer.stats.stored == 5 and sub.indexer.stats.removed == 1
    assert sub.stats.gaps == 0


async def test_orphans_other_media_and_bad_batches_are_skipped(
    wired: tuple[Publisher, KVEventSubscriber, PrefixIndex],
) -> None:
    pub, sub, index = wired
    query = TokenBlockHasher(BS, "m").hashes(TOKENS)
    pub.send([stored([b"x1"], b"never-seen", TOKENS[4:8])])
    pub.send([stored([b"f0"], None, TOKENS[:4], medium="FS")])  # a file tier: not modelled
    pub.send([], payload=b"\xc1 not msgpack")
    pub.send([stored([9], None, TOKENS[:4])])  # integer engine hashes (older vLLM) work too
    await wait_until(lambda: index.match(query, ["r1"])["r1"] == 1, timeout=10, what="the valid block")
    stats = sub.indexer.stats
    assert (stats.orphans, stats.foreign_media, sub.stats.decode_errors) == (1, 1, 1)


async def test_sequence_gap_is_counted_and_restart_clears(
    wired: tuple[Publisher, KVEventSubscriber, PrefixIndex],
) -> None:
    pub, sub, index = wired
    query = TokenBlockHasher(BS, "m").hashes(TOKENS)
    pub.send([stored([1], None, TOKENS[:4])], seq=pub.seq + 3)
    await wait_until(lambda: index.match(query, ["r1"])["r1"] == 1, timeout=10, what="stored block")
    assert sub.stats.gaps == 3
    pub.send([], seq=0)  # the engine restarted: its sequence and its cache start over
    await wait_until(lambda: sub.stats.last_seq == 0, timeout=10, what="restart batch")
    assert index.match(query, ["r1"])["r1"] == 0


def test_speculative_decision_confirmed_by_event() -> None:
    now = [0.0]
    index = PrefixIndex(speculative_ttl_s=2.0, clock=lambda: now[0])
    hasher = TokenBlockHasher(BS, "m")
    indexer = KVEventIndexer(index, hasher)
    prompt = hasher.hashes(TOKENS)
    index.record("r1", prompt, speculative=True)  # the routing decision
    indexer.apply("r1", [stored([b"a", b"b"], None, TOKENS[:8])])  # the engine's events (first two blocks)
    now[0] = 5.0
    assert index.match(prompt, ["r1"]) == {"r1": 2}


def placeholder(hashes: list[Any]) -> list[Any]:
    """vLLM 0.26's OffloadingConnector store event without self_describing_kv_events."""
    return ["BlockStored", hashes, None, [], 0, None, "CPU"]


def test_offloaded_blocks_stay_matchable_on_cpu_after_the_gpu_evicts_them() -> None:
    index = PrefixIndex()
    indexer = KVEventIndexer(index, TokenBlockHasher(BS, "m"))
    query = TokenBlockHasher(BS, "m").hashes(TOKENS)
    indexer.apply("r1", [stored([b"e0", b"e1", b"e2", b"e3"], None, TOKENS[:16])])
    # Written through to CPU, one placeholder per block (blocks_per_chunk 1), after the GPU events.
    indexer.apply("r1", [placeholder([b"e0"]), placeholder([b"e1"]), placeholder([b"e2"])])
    assert index.match_tiers(query, ["r1"]) == {"r1": (4, 4)}
    indexer.apply("r1", [["BlockRemoved", [b"e1", b"e2", b"e3"], "GPU"]])  # evicted from the GPU only
    assert index.match_tiers(query, ["r1"]) == {"r1": (1, 3)}
    indexer.apply("r1", [["BlockRemoved", [b"e2"], "CPU"]])  # and now e2 from CPU too
    assert index.match_tiers(query, ["r1"]) == {"r1": (1, 2)}
    # e3 never reached CPU and left the GPU: its map entry is gone, a late CPU event cannot revive it.
    indexer.apply("r1", [placeholder([b"e3"]), placeholder([b"unknown"])])
    assert indexer.stats.cpu_unmapped == 2
    assert index.match_tiers(query, ["r1"]) == {"r1": (1, 2)}
    # A self-describing CPU event (kv_connector_extra_config.self_describing_kv_events) chains itself.
    indexer.apply("r1", [stored([b"e2", b"e3"], b"e1", TOKENS[8:16], medium="CPU")])
    assert index.match_tiers(query, ["r1"]) == {"r1": (1, 4)}
    indexer.apply("r1", [["AllBlocksCleared"]])
    assert index.match_tiers(query, ["r1"]) == {"r1": (0, 0)}
    assert (indexer.stats.cpu_stored, indexer.stats.cpu_removed) == (5, 1)


async def test_the_simulators_cpu_tier_events_reach_the_index_over_zmq() -> None:
    from gateway.sim.engine import Engine, EngineConfig, Request
    from gateway.sim.kv_events import KVEventPublisher
    from gateway.sim.profiles import get_profile

    bs = 16
    engine = Engine(EngineConfig(get_profile("h200-llama3.1-8b"), num_gpu_blocks=40, kv_offloading_size=0.15))
    engine.pool.record_events = engine.cpu.record_events = True  # type: ignore[union-attr]
    pub = KVEventPublisher("tcp://127.0.0.1:*", "kv-events", bs)
    index = PrefixIndex()
    sub = KVEventSubscriber(
        pub.endpoint, "sim", KVEventIndexer(index, TokenBlockHasher(bs, "m")), "kv-events"
    )
    sub.start()
    prompts = [[seed * 1000 + i for i in range(320)] for seed in (1, 2, 3)]  # 20 blocks each
    steps: list[list[Any]] = []  # each step's batch, the connector's events after the scheduler's
    engine.on_step = lambda: steps.append(engine.pool.take_events() + engine.cpu.take_events())  # type: ignore[union-attr]
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(Request(f"r{i}", ids, 1, block_size=bs))
            engine.run_until_idle()
        query = TokenBlockHasher(bs, "m").hashes(prompts[0])

        def indexed() -> bool:
            if index.match_tiers(query, ["sim"])["sim"] == (0, 20):
                return True
            sub.indexer.clear("sim")  # re-sent until the SUB has joined: replay from a clean index
            for batch in steps:
                pub.publish(batch)
            return False

        # The third prompt pushed the first out of the GPU's 40 blocks; the CPU tier still has it.
        await wait_until(indexed, timeout=10, what="the first prompt indexed as CPU-resident only")
    finally:
        sub.close()
        pub.close()


def test_token_block_hasher_chains_and_isolates() -> None:
    hasher = TokenBlockHasher(BS, "m")
    full = hasher.hashes(TOKENS)
    assert len(full) == 5 and hasher.hashes(TOKENS[:11]) == full[:2]
    assert hasher.hashes([*TOKENS[:4], 0, 0, 0, 0])[0] == full[0]
    assert not set(TokenBlockHasher(BS, "other").hashes(TOKENS)) & set(full)
    assert not set(hasher.hashes(TOKENS, lora_id=3)) & set(full)
    parent = hasher.root()
    for i, h in enumerate(full):
        parent = hasher.chain(parent, TOKENS[i * BS : (i + 1) * BS])
        assert parent == h


async def test_the_simulators_publisher_is_understood() -> None:
    from gateway.sim.kv_cache import block_hashes
    from gateway.sim.kv_events import KVEventPublisher

    pub = KVEventPublisher("tcp://127.0.0.1:*", "kv-events", BS)
    index = PrefixIndex()
    sub = KVEventSubscriber(
        pub.endpoint, "sim", KVEventIndexer(index, TokenBlockHasher(BS, "m")), "kv-events"
    )
    sub.start()
    try:
        engine = block_hashes(TOKENS, BS)
        query = TokenBlockHasher(BS, "m").hashes(TOKENS)
        events = [
            ("stored", ([h], engine[i - 1] if i else None, TOKENS[i * BS : (i + 1) * BS]))
            for i, h in enumerate(engine)
        ]

        def indexed() -> bool:
            if index.match(query, ["sim"])["sim"] >= 5:
                return True
            pub.publish(events)  # re-sent until the SUB has joined; storing twice is harmless
            return False

        await wait_until(indexed, timeout=10, what="the simulator's events indexed")
        pub.publish([("removed", [engine[3]])])
        await wait_until(lambda: index.match(query, ["sim"])["sim"] == 3, timeout=10, what="removal")
    finally:
        sub.close()
        pub.close()


async def _first_frames(sock: zmq.asyncio.Socket, pub: Any, deadline_s: float = 10) -> list[bytes]:
    """Publish until the SUB has joined (ZMQ drops what is sent before) and return what arrived."""

    async def probe() -> list[bytes] | None:
        pub.publish([("cleared", None)])
        try:
            return await asyncio.wait_for(sock.recv_multipart(), 0.05)
        except TimeoutError:
            return None

    frames: list[bytes] = await wait_until(probe, timeout=deadline_s, what="a KV event batch", interval=0)
    return frames


async def test_the_simulator_publisher_binds_or_connects_as_vllm_does() -> None:
    """vLLM binds only an endpoint with `*` (or `::`, ipc, inproc) and connects to any other, and its
    default topic is empty: a subscriber that connects to `tcp://host:port` hears nothing unless
    someone binds there. The simulator must do the same, or tests pass where real engines fail."""
    import zmq.asyncio

    from gateway.sim.kv_events import KVEventPublisher

    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # No `*`: the publisher connects to the subscriber's bound port (a bind there would fail).
    pub = KVEventPublisher.from_config(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}, BS
    )
    try:
        assert not pub.bound
        topic, seq, _ = await _first_frames(sub, pub)
        assert topic == b""  # vLLM's KVEventsConfig.topic default
        assert len(seq) == 8
    finally:
        pub.close()
        sub.close(0)

    # With `*` it binds, and the subscriber connects; an explicit topic is used as given.
    pub = KVEventPublisher.from_config({"endpoint": "tcp://127.0.0.1:*", "topic": "kv-events"}, BS)
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        assert pub.bound and not pub.endpoint.endswith(":*")
        sub.connect(pub.endpoint)
        topic, _, _ = await _first_frames(sub, pub)
        assert topic == b"kv-events"
    finally:
        pub.close()
        sub.close(0)


def test_replica_offsets_follow_vllms_per_rank_rule() -> None:
    from gateway.sim.kv_events import binds, offset_endpoint

    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///run/kv.sock", 1) == "ipc:///run/kv.sock_dp1"
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    assert binds("tcp://*:1") and binds("ipc:///x") and binds("tcp://[::]:1")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://engine-0:5557")


async def test_events_owed_too_long_are_missing_until_usable_ones_come(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway.config import KVEventsSource, PrefixConfig
    from gateway.routing.precise_prefix import PrecisePrefix

    caplog.set_level(logging.INFO, logger="gateway.routing.precise_prefix")
    pub = Publisher()
    precise = PrecisePrefix(PrefixConfig(kv_events_timeout_s=5), "m", BS)
    precise.attach("r1", KVEventsSource(endpoint=pub.endpoint, topic="kv-events"))
    precise.start()
    sub = precise.subscribers["r1"]
    try:
        # Empty batches until the SUB has joined.
        await wait_until(lambda: sub.stats.batches or pub.send([]), timeout=10, what="a first batch")
        assert precise.events_state("r1") == "waiting"  # batches, but nothing usable yet, nothing owed
        precise.expect_events("r1")
        since = sub.stats.awaiting_since
        assert since is not None
        assert precise.events_state("r1", since + 1) == "waiting"
        assert precise.events_state("r1", since + 6) == "missing" and not precise.exact("r1", since + 6)
        assert precise.events_state("r1", since + 7) == "missing"
        warnings = [r for r in caplog.records if "no usable KV events from replica r1" in r.getMessage()]
        assert len(warnings) == 1  # reported once, not per request

        # Events of another block size are as good as none.
        seen = sub.stats.batches
        pub.send([["BlockStored", [1], None, list(range(8)), 8, None, "GPU"]])
        await wait_until(lambda: sub.stats.batches > seen, timeout=10, what="the mismatched batch")
        assert precise.events_state("r1", since + 8) == "missing"

        pub.send([stored([2], None, TOKENS[:4])])
        await wait_until(lambda: sub.stats.awaiting_since is None, timeout=10, what="a usable batch")
        assert precise.events_state("r1") == "ok" and precise.exact("r1", time.monotonic())
        assert any("flow again" in r.getMessage() for r in caplog.records)
    finally:
        precise.close()
        pub.sock.close(0)
