"""radix_cache_aware: a faithful re-implementation of the SGLang router's `cache_aware` policy.

Kept for side-by-side comparison with prefix_affinity; it reproduces the rule, not our ideas:

1. Load is the gateway's own in-flight request count per replica. If the fleet is imbalanced,
   `max - min > balance_abs_threshold` and `max > min * balance_rel_threshold`, the least-loaded
   replica wins (and the text is still inserted under it).
2. Otherwise the request text is matched against one character-level radix tree whose nodes are
   tagged with the replicas ("tenants") that were sent text through them. If the matched share of
   the text is above `cache_threshold`, the replica holding the deepest match wins; else the
   replica with the smallest tree (fewest characters), the one with the most cache room as the
   router sees it. When several replicas hold the deepest match the router takes the first tenant
   of that node's hash map: neither the most recent nor the least loaded, but a fixed arbitrary
   one per node, modelled here by a per-node hash order. The match refreshes that tenant's access
   time along the path, as the router's does.
3. Every `eviction_interval_s` each tenant's least recently used leaves are evicted until it holds
   at most `max_tree_size` characters. The tree never hears what an engine really cached or evicted.

Defaults are the router's command line (sglang-router 0.2: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5, eviction every 120 s, max_tree_size 2**26;
later versions evict every 60 s). As in the router, the text is inserted at decision time; after a
retry, also under the replica that finally took it. Unlike the router, a tenant that is not a
candidate (unhealthy) is never chosen: the router would fall back to its first healthy worker.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import Candidate, Policy, ReplicaView, RequestFeatures


class RadixCacheAwareParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_threshold: float = Field(
        0.3, ge=0, le=1, description="Matched share of the text above which to follow it"
    )
    balance_abs_threshold: int = Field(64, ge=0, description="Imbalanced if max - min load exceeds this...")
    balance_rel_threshold: float = Field(1.5, ge=1, description="...and max load exceeds min load times this")
    eviction_interval_s: float = Field(120.0, gt=0, description="How often trees are trimmed")
    max_tree_size: int = Field(2**26, gt=0, description="Characters each replica's tree keeps after a trim")


class _Node:
    __slots__ = ("children", "parent", "seed", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None, seed: int) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's text -> child
        self.tenants: dict[str, float] = {}  # tenant -> last access time
        # The router's per-node tenant map iterates in an order fixed by that map's own hasher; a
        # split copies the map, hasher included, into the upper half.
        self.seed = seed

    def first_tenant(self) -> str:
        seed = self.seed
        return min(self.tenants, key=lambda t: xxhash.xxh64_intdigest(t.encode(), seed))


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix: binary search on slice equality (C speed on long edges)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """A multi-tenant character radix tree with per-tenant sizes and LRU leaf eviction."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._seeds = itertools.count()
        self.root = _Node("", None, next(self._seeds))
        self.size: dict[str, int] = {}  # tenant -> characters it holds
        self._clock = clock

    def _touch(self, node: _Node, tenant: str, now: float) -> None:
        if tenant not in node.tenants:
            self.size[tenant] = self.size.get(tenant, 0) + len(node.text)
        node.tenants[tenant] = now

    def insert(self, text: str, tenant: str) -> None:
        now = self._clock()
        node = self.root
        self._touch(node, tenant, now)
        pos = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node, next(self._seeds))
                node.children[text[pos]] = leaf
                self._touch(leaf, tenant, now)
                return
            n = _common_prefix(child.text, text[pos:])
            if n < len(child.text):
                child = self._split(child, n)
            self._touch(child, tenant, now)
            node = child
            pos += n

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n characters; returns the new upper half (same tenants)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.text[:n], parent, child.seed)
        upper.tenants = dict(child.tenants)
        parent.children[upper.text[0]] = upper
        child.text = child.text[n:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def prefix_match(self, text: str) -> tuple[int, str | None]:
        """(matched characters, the first tenant of the deepest matched node); like the router's,
        the match counts as an access by that tenant on the whole path."""
        node = self.root
        pos = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            n = _common_prefix(child.text, text[pos:])
            pos += n
            node = child
            if n < len(child.text):
                break
        if not node.tenants:
            return 0, None
        tenant = node.first_tenant()
        now = self._clock()
        hit: _Node | None = node
        while hit is not None:
            hit.tenants[tenant] = now
            hit = hit.parent
        return pos, tenant

    def holds(self, text: str, tenant: str) -> bool:
        """Whether `tenant` was given all of `text` (a lookup that, unlike a match, touches nothing)."""
        node = self.root
        pos = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                return False
            if not text.startswith(child.text, pos):  # differs inside the edge, or ends there
                return child.text.startswith(text[pos:]) and tenant in child.tenants
            node = child
            pos += len(child.text)
        return tenant in node.tenants

    def smallest_tenant(self, tenants: Sequence[str]) -> str:
        return min(tenants, key=lambda t: self.size.get(t, 0))

    def remove_tenant(self, tenant: str) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.pop(tenant, None)
            stack.extend(node.children.values())
        self.size.pop(tenant, None)
        self._prune(self.root)

    def _prune(self, node: _Node) -> None:
        for key, child in list(node.children.items()):
            self._prune(child)
            if not child.tenants and not child.children:
                del node.children[key]

    def evict(self, max_size: int) -> None:
        """Drop each oversized tenant's least recently used leaves until it fits in max_size."""
        over = {t for t, s in self.size.items() if s > max_size}
        if not over:
            return
        leaves: dict[str, list[tuple[float, int, _Node]]] = {t: [] for t in over}
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for t in over.intersection(node.tenants):
                if not any(t in c.tenants for c in node.children.values()):
                    leaves[t].append((node.tenants[t], id(node), node))
        for t, heap in leaves.items():
            heapq.heapify(heap)
            while self.size[t] > max_size and heap:
                _, _, node = heapq.heappop(heap)
                if node is self.root:
                    continue
                del node.tenants[t]
                self.size[t] -= len(node.text)
                parent = node.parent
                assert parent is not None
                if not node.tenants and not node.children:
                    del parent.children[node.text[0]]
                if parent is not self.root and not any(t in c.tenants for c in parent.children.values()):
                    heapq.heappush(heap, (parent.tenants[t], id(parent), parent))


class RadixCacheAware(Policy[RadixCacheAwareParams]):
    def __init__(self, params: RadixCacheAwareParams, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(params)
        self.tree = RadixTree(clock)
        self._clock = clock
        self._next_eviction = clock() + params.eviction_interval_s

    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        if not candidates:
            return []
        p = self.params
        self._maybe_evict(p)
        by_load = sorted(candidates, key=lambda c: c.replica.inflight_requests)
        max_load = by_load[-1].replica.inflight_requests
        min_load = by_load[0].replica.inflight_requests
        text = request.text
        if max_load - min_load > p.balance_abs_threshold and max_load > min_load * p.balance_rel_threshold:
            first = by_load[0]
        else:
            names = [c.replica.name for c in candidates]
            matched, holder = self.tree.prefix_match(text)
            if text and matched / len(text) > p.cache_threshold and holder in names:
                chosen = holder
            else:
                chosen = self.tree.smallest_tenant(names)
            first = candidates[names.index(chosen)]
        # Like the router, the text goes into the tree at decision time (in both branches), so the
        # next request sees it even before this one is sent.
        if text:
            self.tree.insert(text, first.replica.name)
        return [first, *(c for c in by_load if c is not first)]

    def on_routed(self, request: RequestFeatures, replica: ReplicaView) -> None:
        # A retry went past the replica chosen at decision time: the text is also there now.
        if request.text and not self.tree.holds(request.text, replica.name):
            self.tree.insert(request.text, replica.name)

    def _maybe_evict(self, p: RadixCacheAwareParams) -> None:
        now = self._clock()
        if now >= self._next_eviction:
            self._next_eviction = now + p.eviction_interval_s
            self.tree.evict(p.max_tree_size)
