"""least_load and the benchmark's oracle policy."""

from __future__ import annotations

from collections import Counter

from gateway.routing.policy import load_policy
from tests.policies.helpers import candidates, engine_report, replicas, request


def test_least_load_counts_own_tokens_and_fresh_engine_figures() -> None:
    p = load_policy("least_load")
    reps = replicas(3)
    reps[0].lease(5000)
    engine_report(reps[1], waiting=2, running=1)  # 3 x 1024 tokens by the engine's count
    ranked = p.rank(request(), candidates(reps))
    assert [c.replica.name for c in ranked] == ["r2", "r1", "r0"]


def test_least_load_takes_the_larger_of_own_and_engine_load() -> None:
    p = load_policy("least_load")
    reps = replicas(2)
    reps[0].lease(3000)
    engine_report(reps[0], running=1)  # our own request, as the engine sees it: not added twice
    reps[1].lease(3500)
    assert p.rank(request(), candidates(reps))[0].replica.name == "r0"


def test_least_load_counts_other_gateways_in_flight_load() -> None:
    p = load_policy("least_load")
    reps = replicas(3)
    reps[0].lease(3000)
    reps[1].remote_inflight_tokens = 5000  # another gateway's requests, from shared state
    reps[1].remote_inflight_requests = 2
    ranked = p.rank(request(), candidates(reps))
    assert [c.replica.name for c in ranked] == ["r2", "r0", "r1"]


def test_least_load_rotates_on_ties() -> None:
    p = load_policy("least_load")
    reps = replicas(4)
    firsts = Counter([p.rank(request(), candidates(reps))[0].replica.name for _ in range(8)])
    assert firsts == {"r0": 2, "r1": 2, "r2": 2, "r3": 2}
