"""The failover scenario's parts that run without a fleet: its variants, the seam measure, and
finding the process behind an engine's port (for engines the bench did not start)."""

from __future__ import annotations

import os
import socket

from bench import procs, seams
from bench.faults import FaultScenario, Outcome
from bench.scenario import load_scenario


def test_the_failover_scenario_runs_failover_off_then_on() -> None:
    scenario = load_scenario("failover")
    assert isinstance(scenario, FaultScenario)
    assert scenario.variants["failover_off"] == {"pool": {"failover": {"mid_stream": False}}}
    assert scenario.variants["failover_on"]["pool"]["failover"]["mid_stream"] is True
    assert scenario.load.concurrency == 40 and scenario.fleet.replicas == 4
    assert [s.action for s in scenario.size("quick").faults] == ["kill"]


def test_the_seam_is_the_longest_gap_less_the_median_one() -> None:
    assert round(seams.seam_s([0.0, 0.1, 0.2, 0.9, 1.0]) or 0, 9) == 0.6
    assert seams.seam_s([0.0, 0.1]) is None  # one gap says nothing


def test_the_summary_counts_cut_streams_and_checks_only_continued_ones() -> None:
    done = Outcome("a", 0.0, outcome="completed", status=200, chunk_times=[0.0, 0.1, 0.2, 1.2])
    cut = Outcome("b", 0.0, outcome="error", status=200)
    refused = Outcome("c", 0.0, outcome="error", status=503)
    plain = Outcome("d", 0.0, outcome="completed", status=200)
    access = {"a": {"resumed": ["disconnected@r0"]}, "d": {}}
    outcomes = [done, cut, refused, plain]
    assert seams.resumed(outcomes, access) == [done]
    summary = seams.summary(outcomes, access, [True])
    assert summary["cut"] == 1 and summary["resumed"] == 1
    assert summary["resumed_by_reason"] == {"disconnected": 1}
    assert summary["token_identical"] == summary["token_identical_checked"] == 1
    assert round(summary["seam_added_ms_p50"]) == 900


def test_the_control_takes_answers_never_continued_spread_over_the_run() -> None:
    body = {"messages": []}
    plain = [Outcome(f"p{i}", 0.0, outcome="completed", status=200, body=body) for i in range(50)]
    continued = Outcome("c", 0.0, outcome="completed", status=200, body=body)
    failed = Outcome("f", 0.0, outcome="error", status=200, body=body)
    access = {o.marker: {} for o in plain} | {"c": {"resumed": ["ejected@r1"]}, "f": {}}
    picked = seams.control([continued, failed, *plain], access, 2)
    assert len(picked) == 20  # at least 20 where there are
    assert picked[0] is plain[0] and picked[-1] in plain[45:] and continued not in picked  # the whole run
    assert len({o.marker for o in picked}) == 20
    assert seams.control(plain[:5], access, 10) == plain[:5]
    summary = seams.summary([continued], access, [False], [True, True, False])
    assert (summary["control_identical"], summary["control_checked"]) == (2, 3)


def test_the_process_listening_on_a_port_is_found() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert procs.listener_pids(s.getsockname()[1]) == [os.getpid()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: not an engine
        assert procs.listener_pids(s.getsockname()[1]) == []
