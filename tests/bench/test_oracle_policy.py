"""The benchmark's oracle policy (bench/oracle_policy.py), loaded like any plugin by "module:Class"."""

from __future__ import annotations

from bench.oracle_policy import OraclePolicy
from gateway.routing.policy import load_policy
from tests.policies.helpers import candidates, replicas, request


def test_oracle_pins_group_g_to_replica_g_mod_n_by_name() -> None:
    p = load_policy("bench.oracle_policy:OraclePolicy")
    assert isinstance(p, OraclePolicy)
    reps = replicas(4)
    shuffled = candidates([reps[2], reps[0], reps[3], reps[1]])
    for g in range(8):
        ranked = p.rank(request(headers={"x-kvgate-group": f"g{g}"}), shuffled)
        assert ranked[0].replica.name == f"r{g % 4}"
        assert len(ranked) == 4
    ranked = p.rank(request(), shuffled)  # no group: least in-flight
    assert len(ranked) == 4
