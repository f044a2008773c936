"""radix_cache_aware follows the SGLang router's cache_aware rule in each of its branches."""

from __future__ import annotations

from gateway.routing.policy import load_policy
from policies.radix_cache_aware import RadixCacheAware, RadixCacheAwareParams, RadixTree
from tests.policies.helpers import candidates, replicas, request

SYSTEM = "You are a helpful assistant for the ACME corporation. " * 20  # 1100 chars


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def names(ranked: list) -> list[str]:
    return [c.replica.name for c in ranked]


def load(replica, n: int) -> None:
    for _ in range(n):
        replica.lease(100)


def test_defaults_are_the_routers() -> None:
    p = load_policy("radix_cache_aware")
    assert isinstance(p, RadixCacheAware)
    assert p.params == RadixCacheAwareParams(
        cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5, max_tree_size=2**26
    )
    assert p.params.eviction_interval_s == 120


def test_high_match_follows_the_replica_holding_the_text() -> None:
    p = load_policy("radix_cache_aware")
    reps = replicas(3)
    first = request(text=SYSTEM + "question one")
    p.on_routed(first, reps[2])
    ranked = p.rank(request(text=SYSTEM + "question two"), candidates(reps))
    assert names(ranked)[0] == "r2"


def test_low_match_goes_to_the_smallest_tree() -> None:
    p = load_policy("radix_cache_aware")
    reps = replicas(3)
    p.on_routed(request(text="a" * 1000), reps[0])
    p.on_routed(request(text="b" * 500), reps[1])
    p.on_routed(request(text="c" * 200), reps[2])
    # 200 of 1000 characters match r0's text: 0.2 <= 0.3, so the match is ignored.
    ranked = p.rank(request(text="a" * 200 + "z" * 800), candidates(reps))
    assert names(ranked)[0] == "r2"
    # Above the threshold (400/1000) the match wins even though r0 has the biggest tree.
    ranked = p.rank(request(text="a" * 400 + "z" * 600), candidates(reps))
    assert names(ranked)[0] == "r0"


def test_imbalance_needs_both_thresholds() -> None:
    def warm_on_r0() -> RadixCacheAware:
        p = load_policy("radix_cache_aware")
        assert isinstance(p, RadixCacheAware)
        p.tree.insert(SYSTEM, "r0")
        return p

    req = request(text=SYSTEM + "q")
    # 300 vs 230: the difference (70) exceeds 64, but 300 < 230 * 1.5: still balanced, cache wins.
    reps = replicas(2)
    load(reps[0], 300)
    load(reps[1], 230)
    assert names(warm_on_r0().rank(req, candidates(reps)))[0] == "r0"
    # 300 vs 199: 300 > 298.5 and 101 > 64: imbalanced, shortest queue wins over the cache.
    reps = replicas(2)
    load(reps[0], 300)
    load(reps[1], 199)
    assert names(warm_on_r0().rank(req, candidates(reps)))[0] == "r1"
    # 60 vs 0: infinitely unequal in ratio but within the absolute threshold: balanced.
    reps = replicas(2)
    load(reps[0], 60)
    assert names(warm_on_r0().rank(req, candidates(reps)))[0] == "r0"


def test_imbalanced_branch_still_inserts_under_the_chosen_replica() -> None:
    p = load_policy("radix_cache_aware")
    reps = replicas(2)
    load(reps[0], 100)
    chosen = p.rank(request(text=SYSTEM), candidates(reps))[0].replica
    assert chosen.name == "r1"
    assert p.tree.prefix_match(SYSTEM) == (len(SYSTEM), "r1")


def test_text_is_inserted_at_decision_time() -> None:
    """A burst of new prefixes: each decision already sees the previous ones (smallest tree)."""
    p = load_policy("radix_cache_aware")
    reps = replicas(3)
    firsts = [p.rank(request(text=f"{k} " + SYSTEM), candidates(reps))[0].replica.name for k in "abc"]
    assert sorted(firsts) == ["r0", "r1", "r2"]
    # A retry sent the last one elsewhere: the tree learns that replica holds it too.
    p.on_routed(request(text="c " + SYSTEM), reps[0])
    assert p.tree.size["r0"] > len(SYSTEM) + 2


def test_tree_splits_edges_and_tracks_sizes() -> None:
    tree = RadixTree()
    tree.insert("abcdef", "r0")
    tree.insert("abcxyz", "r1")
    assert tree.prefix_match("abcxy!") == (5, "r1")
    assert tree.prefix_match("abcd") == (4, "r0")
    assert tree.prefix_match("zzz")[0] == 0
    assert tree.size == {"r0": 6, "r1": 6}
    tree.insert("abcdef", "r1")
    assert tree.size["r1"] == 9


def test_lru_eviction_trims_each_tenant_to_max_size() -> None:
    clock = Clock()
    tree = RadixTree(clock)
    for i, word in enumerate(["old-" + "x" * 20, "mid-" + "y" * 20, "new-" + "z" * 20]):
        clock.now = float(i)
        tree.insert(word, "r0")
    tree.insert("old-" + "x" * 20, "r1")
    tree.evict(50)
    assert tree.size["r0"] <= 50
    assert tree.prefix_match("old-" + "x" * 20) == (24, "r1")  # r0 lost its oldest text, r1 kept it
    assert tree.prefix_match("new-" + "z" * 20) == (24, "r0")
    assert tree.size["r1"] == 24


def test_eviction_runs_on_its_interval() -> None:
    clock = Clock()
    p = RadixCacheAware(RadixCacheAwareParams(max_tree_size=10, eviction_interval_s=120), clock=clock)
    reps = replicas(2)
    p.on_routed(request(text="q" * 100), reps[0])
    clock.now = 119
    p.rank(request(text="x"), candidates(reps))
    assert p.tree.size["r0"] == 100
    clock.now = 121
    p.rank(request(text="x"), candidates(reps))
    assert p.tree.size["r0"] == 0


def test_a_shared_node_answers_with_a_fixed_tenant_not_the_latest() -> None:
    """Like the router's per-node hash map: which holder wins is fixed per node, arbitrary across
    nodes, and does not follow whoever was sent the text last."""
    tree = RadixTree()
    firsts = set()
    for k in range(16):
        text = f"prompt {k}: " + SYSTEM
        tree.insert(text, "r0")
        tree.insert(text, "r1")
        _, first = tree.prefix_match(text)
        other = "r1" if first == "r0" else "r0"
        tree.insert(text, other)  # now the most recent holder
        assert tree.prefix_match(text) == (len(text), first)
        firsts.add(first)
    assert firsts == {"r0", "r1"}


def test_a_match_refreshes_the_matched_tenants_path() -> None:
    clock = Clock()
    tree = RadixTree(clock)
    tree.insert("a" * 30, "r0")
    clock.now = 1.0
    tree.insert("b" * 30, "r0")
    clock.now = 2.0
    assert tree.prefix_match("a" * 30 + "?") == (30, "r0")  # "a..." is now the most recent
    tree.evict(30)
    assert tree.prefix_match("a" * 30) == (30, "r0")
    assert tree.prefix_match("b" * 30)[0] == 0


def test_holds_checks_the_whole_text_without_touching() -> None:
    clock = Clock()
    tree = RadixTree(clock)
    tree.insert("abcdef", "r0")
    tree.insert("abcxyz", "r1")
    assert tree.holds("abcdef", "r0") and tree.holds("abcd", "r0") and tree.holds("abc", "r1")
    assert not tree.holds("abcdef", "r1") and not tree.holds("abcdefg", "r0") and not tree.holds("q", "r0")
    clock.now = 5.0
    tree.holds("abcdef", "r0")
    assert tree.root.tenants["r0"] == 0.0
