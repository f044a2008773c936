"""PrefixIndex: leading-block matches, per-replica LRU bounds and order, speculative expiry."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import PrefixConfig
from gateway.prefix_index import PrefixIndex


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
    """The obvious implementation: one ordered dict per replica, a naive leading-block walk."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def record(self, replica: str, hashes: list[int]) -> None:
        lru = self.lru.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def match(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        out = {}
        for r in replicas:
            held = self.lru.get(r, {})
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            out[r] = n
        return out


ops = st.lists(
    st.tuples(
        st.sampled_from(["record", "discard", "clear", "remove"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 12), max_size=8),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, capacity=st.integers(1, 6), probe=st.lists(st.integers(0, 12), max_size=8))
def test_matches_reference_model(
    ops: list[tuple[str, str, list[int]]], capacity: int, probe: list[int]
) -> None:
    index = PrefixIndex(default_capacity=capacity)
    ref = Reference(capacity)
    for op, replica, hashes in ops:
        if op == "record":
            index.record(replica, hashes)
            ref.record(replica, hashes)
        elif op == "discard":
            index.discard(replica, hashes)
            for h in hashes:
                ref.lru.get(replica, {}).pop(h, None)
        elif op == "clear":
            index.clear_replica(replica)
            ref.lru.get(replica, OrderedDict()).clear()
        else:
            index.remove_replica(replica)
            ref.lru.pop(replica, None)
        for r in "abc":
            assert index.snapshot(r) == list(ref.lru.get(r, []))
            assert len(index.snapshot(r)) <= capacity
        assert index.match(probe, ["a", "b", "c"]) == ref.match(probe, ["a", "b", "c"])
