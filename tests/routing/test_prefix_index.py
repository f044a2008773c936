"""PrefixIndex: leading-block matches, per-replica LRU bounds and order, speculative expiry."""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import accumulate

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import PrefixConfig
from gateway.routing.prefix_index import PrefixIndex


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_match_counts_leading_blocks_only() -> None:
    index = PrefixIndex()
    index.record("r1", [1, 2, 3])
    index.record("r2", [1, 2, 3, 4, 5])
    assert index.match([1, 2, 3, 4, 5, 6], ["r1", "r2", "r3"]) == {"r1": 3, "r2": 5, "r3": 0}
    # A hole stops the walk even though later blocks are held.
    assert index.match([1, 9, 3], ["r1", "r2"]) == {"r1": 1, "r2": 1}
    assert index.match([9, 1, 2], ["r1", "r2"]) == {"r1": 0, "r2": 0}
    assert index.match([], ["r1"]) == {"r1": 0}
    assert index.match([1], []) == {}


def test_lru_evicts_a_prompts_tail_before_its_head() -> None:
    index = PrefixIndex(default_capacity=3)
    index.record("r", [1, 2, 3])
    index.record("r", [4])
    assert index.snapshot("r") == [2, 1, 4]
    assert index.match([1, 2, 3], ["r"]) == {"r": 2}
    index.record("r", [5, 6])
    assert index.snapshot("r") == [4, 6, 5]
    assert index.match([1], ["r"]) == {"r": 0}


def test_set_capacity_shrinks_and_clear_keeps_it() -> None:
    index = PrefixIndex(default_capacity=100)
    index.record("r", list(range(50)))
    index.set_capacity("r", 10)
    assert index.snapshot("r") == list(range(9, -1, -1))
    index.clear_replica("r")
    assert index.snapshot("r") == []
    index.record("r", list(range(20)))
    assert len(index.snapshot("r")) == 10
    assert index.stats()["replicas"] == {"r": {"blocks": 10, "speculative": 0, "capacity": 10}}


def test_removed_replica_bit_is_reused_without_its_entries() -> None:
    index = PrefixIndex()
    index.record("old", [1, 2])
    index.remove_replica("old")
    index.record("new", [7])
    assert index.match([1, 2], ["old", "new"]) == {"old": 0, "new": 0}
    assert index.match([7], ["new"]) == {"new": 1}
    assert index.stats()["distinct_blocks"] == 1


def test_a_lower_tier_extends_each_replicas_match_past_its_gpu_blocks() -> None:
    index = PrefixIndex(prefix_closed=True)
    cpu = index.add_lower_tier(default_capacity=100)
    assert index.add_lower_tier(default_capacity=5) is cpu
    cpu.record("b", [1, 2, 3, 4])  # b's replica bit is allocated by the tier above
    index.record("a", [1, 2])
    index.record("b", [1])
    cpu.record("a", [3])
    query = [1, 2, 3, 4, 5]
    assert index.match(query, ["a", "b", "c"]) == {"a": 2, "b": 1, "c": 0}
    # Either tier holds a block: a's GPU blocks 1-2 and its CPU block 3; all four of b's on CPU.
    assert index.match_tiers(query, ["a", "b", "c"]) == {"a": (2, 3), "b": (1, 4), "c": (0, 0)}
    index.discard("b", [1])  # the GPU evicted it; the CPU copy still serves
    assert index.match_tiers(query, ["b"]) == {"b": (0, 4)}
    assert index.stats()["replicas"]["b"] == {  # type: ignore[index]
        "blocks": 0, "speculative": 0, "capacity": 65536, "cpu_blocks": 4, "cpu_capacity": 100,
    }  # fmt: skip
    index.clear_replica("a")  # AllBlocksCleared, an engine restart: every tier
    assert index.match_tiers(query, ["a"]) == {"a": (0, 0)}
    index.remove_replica("b")  # its bit is freed once, by the tier above, and reused
    index.record("d", [1])
    assert index.match_tiers(query, ["b", "d"]) == {"b": (0, 0), "d": (1, 1)}


def test_discard_removes_only_that_replica() -> None:
    index = PrefixIndex()
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2, 3])
    index.discard("a", [2])
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 3}


def test_speculative_entries_expire_unless_confirmed() -> None:
    clock = FakeClock()
    index = PrefixIndex(speculative_ttl_s=2.0, clock=clock)
    index.record("a", [1, 2, 3], speculative=True)
    index.record("b", [1, 2], speculative=True)
    clock.now += 1.0
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 3, "b": 2}
    index.record("a", [1, 2])  # an event confirms the head only
    index.record("b", [1, 2], speculative=True)  # refreshed
    clock.now += 1.5
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 2, "b": 2}
    assert index.snapshot("a") == [1, 2][::-1]
    clock.now += 1.0
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 2, "b": 0}
    assert index.stats()["replicas"]["b"]["blocks"] == 0
    assert index.stats()["replicas"]["a"]["speculative"] == 0


def test_speculative_on_confirmed_block_keeps_it_confirmed() -> None:
    clock = FakeClock()
    index = PrefixIndex(speculative_ttl_s=1.0, clock=clock)
    index.record("a", [1])
    index.record("a", [1, 2], speculative=True)
    clock.now += 5
    assert index.match([1, 2], ["a"]) == {"a": 1}


def test_snapshot_merge_round_trip() -> None:
    src = PrefixIndex()
    src.record("r", [1, 2, 3])
    src.record("r", [2, 8])
    dst = PrefixIndex()
    dst.merge("r", src.snapshot("r"))
    assert dst.snapshot("r") == src.snapshot("r")
    assert dst.match([1, 2, 3], ["r"]) == {"r": 3}


def test_from_config() -> None:
    index = PrefixIndex.from_config(PrefixConfig(max_blocks_per_replica=2, speculative_ttl_s=0.5))
    assert (index.default_capacity, index.speculative_ttl_s) == (2, 0.5)
    assert (
        PrefixIndex.from_config(PrefixConfig()).default_capacity == PrefixConfig().default_blocks_per_replica
    )


def test_many_replicas() -> None:
    index = PrefixIndex()
    names = [f"r{i}" for i in range(256)]
    for i, name in enumerate(names):
        index.record(name, list(range(i % 40)))
    got = index.match(list(range(40)), names)
    assert got == {name: i % 40 for i, name in enumerate(names)}


class Reference:
    """The obvious implementation: per replica an ordered dict of hash -> expiry (inf when confirmed),
    expired entries purged before each record, a naive leading-block walk."""

    def __init__(self, capacity: int, ttl: float, clock: FakeClock) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        self.lru: dict[str, OrderedDict[int, float]] = {}

    def purge(self, replica: str) -> None:
        lru = self.lru.get(replica, OrderedDict())
        for h in [h for h, exp in lru.items() if exp <= self.clock.now]:
            del lru[h]

    def record(self, replica: str, hashes: list[int], speculative: bool) -> None:
        self.purge(replica)
        lru = self.lru.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            if not speculative:
                lru[h] = math.inf
            elif lru.get(h) != math.inf:
                lru[h] = self.clock.now + self.ttl
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def snapshot(self, replica: str) -> list[int]:
        self.purge(replica)
        return list(self.lru.get(replica, []))

    def match(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        out = {}
        for r in replicas:
            held = self.lru.get(r, {})
            n = 0
            while n < len(hashes) and held.get(hashes[n], -math.inf) > self.clock.now:
                n += 1
            out[r] = n
        return out


ops = st.lists(
    st.tuples(
        st.sampled_from(["record", "speculate", "discard", "clear", "remove", "tick"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 12), max_size=8),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, capacity=st.integers(1, 6), probe=st.lists(st.integers(0, 12), max_size=8))
def test_matches_reference_model(
    ops: list[tuple[str, str, list[int]]], capacity: int, probe: list[int]
) -> None:
    clock = FakeClock()
    index = PrefixIndex(default_capacity=capacity, speculative_ttl_s=2.0, clock=clock)
    ref = Reference(capacity, 2.0, clock)
    for op, replica, hashes in ops:
        if op in ("record", "speculate"):
            index.record(replica, hashes, speculative=op == "speculate")
            ref.record(replica, hashes, speculative=op == "speculate")
        elif op == "discard":
            index.discard(replica, hashes)
            for h in hashes:
                ref.lru.get(replica, {}).pop(h, None)
        elif op == "clear":
            index.clear_replica(replica)
            ref.lru.get(replica, OrderedDict()).clear()
        elif op == "remove":
            index.remove_replica(replica)
            ref.lru.pop(replica, None)
        else:
            clock.now += len(hashes) * 0.5  # 0 to 4 s: entries expire at 2 s
        assert index.match(probe, ["a", "b", "c"]) == ref.match(probe, ["a", "b", "c"])
        for r in "abc":
            assert index.snapshot(r) == ref.snapshot(r)
            assert len(index.snapshot(r)) <= capacity


def chain(tokens: list[int]) -> list[int]:
    """Chained block hashes of a prompt of one-token blocks, as PrefixHasher chains them."""
    return list(accumulate(tokens, lambda h, t: hash((h, t)), initial=7))[1:]


prompts = st.lists(st.integers(0, 2), max_size=14)  # few tokens: prompts share prefixes all the time
closed_ops = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "capacity", "clear", "remove"]),
        st.sampled_from(["a", "b", "c", "d"]),
        prompts,
        st.integers(1, 12),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=closed_ops, probes=st.lists(prompts, min_size=1, max_size=4), capacity=st.integers(1, 10))
def test_bisection_of_a_prefix_closed_index_matches_the_walk(
    ops: list[tuple[str, str, list[int], int]], probes: list[list[int]], capacity: int
) -> None:
    closed = PrefixIndex(default_capacity=capacity, prefix_closed=True)
    walked = PrefixIndex(default_capacity=capacity)
    for op, replica, tokens, size in ops:
        for index in (closed, walked):
            if op == "record":
                index.record(replica, chain(tokens))
            elif op == "capacity":
                index.set_capacity(replica, size)
            elif op == "clear":
                index.clear_replica(replica)
            else:
                index.remove_replica(replica)
        for probe in probes:
            assert closed.match(chain(probe), "abcd") == walked.match(chain(probe), "abcd")
    assert closed.prefix_closed


def test_discard_and_speculation_end_the_bisection() -> None:
    blocks = chain([0] * 8)
    index = PrefixIndex(prefix_closed=True)
    index.record("a", blocks)
    index.discard("a", blocks[2:3])
    assert not index.prefix_closed
    assert index.match(blocks, ["a"]) == {"a": 2}  # bisection would look at blocks 0, 1, 3 and 7: 8
    index = PrefixIndex(prefix_closed=True)
    index.record("a", blocks, speculative=True)
    assert not index.prefix_closed
