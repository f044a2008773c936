"""bench.overhead's bookkeeping: which gateways a run starts, and how rounds of the concurrent
measurement add up (the measurement itself is the benchmark's, not a test's)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import pytest

from bench.overhead import Pair, gateway_sides, merge_rounds, peer_ratios, pin_plan, pinned


def test_one_gateway_per_variant_server_and_transport_named_by_what_differs():
    def sides(server: str, transport: str, variant: list[str] | None = None) -> list[tuple[str, ...]]:
        return gateway_sides(argparse.Namespace(server=server, transport=transport, variant=variant or []))

    assert sides("httptools", "http1") == [("kvgate", "httptools", "http1", sys.executable)]
    assert [label for label, *_ in sides("both", "http1")] == [
        "kvgate [httptools server]",
        "kvgate [aiohttp server]",
    ]
    assert len(sides("both", "both")) == 4
    assert sides("aiohttp", "both")[1] == ("kvgate [aiohttp client]", "aiohttp", "aiohttp", sys.executable)
    both = sides("httptools", "http1", ["interpreted=/a/python", "compiled=/b/python"])
    assert both == [
        ("kvgate [interpreted]", "httptools", "http1", "/a/python"),
        ("kvgate [compiled]", "httptools", "http1", "/b/python"),
    ]


def test_rounds_add_up_counts_and_cpu_and_take_the_median_latency():
    rounds = [
        {"requests": 100, "errors": 0, "elapsed_s": 1.0, "p50": 1.0, "p95": 2.0, "p99": 9.0, "cpu_s": 0.01},
        {"requests": 300, "errors": 2, "elapsed_s": 1.0, "p50": 3.0, "p95": 4.0, "p99": 5.0, "cpu_s": 0.03},
        {"requests": 200, "errors": 0, "elapsed_s": 1.0, "p50": 2.0, "p95": 3.0, "p99": 7.0, "cpu_s": 0.02},
    ]
    total = merge_rounds(rounds)
    assert total["requests"] == 600 and total["errors"] == 2 and total["rps"] == 200
    assert (total["p50"], total["p99"]) == (2.0, 7.0)
    assert total["gateway_cpu_us_per_request"] == pytest.approx(100.0)
    assert "gateway_cpu_us_per_request" not in merge_rounds(
        [{k: v for k, v in r.items() if k != "cpu_s"} for r in rounds]
    )


def test_ratios_are_kvgate_over_the_peer():
    def pair(name: str, added_p50: float, added_p99: float) -> Pair:
        direct = {"p50": 1.0, "p95": 1.0, "p99": 1.0}
        return Pair(name, direct, {"p50": 1.0 + added_p50, "p95": 1.0, "p99": 1.0 + added_p99})

    pairs = [
        pair("(a) sequential [kvgate]", 0.2, 0.4),
        pair("(a) sequential [peer]", 0.4, 0.4),
        pair("(b) stream first chunk [kvgate]", 0.1, 0.3),
        pair("(b) stream first chunk [peer]", 0.1, 0.6),
    ]
    conc = {
        "kvgate x64": {"gateway_cpu_us_per_request": 60.0, "rps": 3000.0},
        "peer x64": {"gateway_cpu_us_per_request": 120.0, "rps": 2000.0},
    }
    row = peer_ratios(pairs, conc, ["peer"]).splitlines()[-1]
    assert row == "| kvgate / peer | 0.50 | 1.00 | 0.50 | 0.50 | 1.50 |"


def test_pinning_gives_each_process_a_core_and_the_clients_the_rest():
    before = os.sched_getaffinity(0)
    try:
        if len(before) < 2 or shutil.which("taskset") is None:
            with pytest.raises(SystemExit, match="--pin needs taskset"):
                pin_plan(1)
            return
        (core,) = pin_plan(1)
        assert core in before and core not in os.sched_getaffinity(0)
        assert os.sched_getaffinity(0) == before - {core}
        assert pinned(["python3"], core) == ["taskset", "-c", str(core), "python3"]
        with pytest.raises(SystemExit, match=f"--pin needs taskset and {len(before) + 1} cores"):
            pin_plan(len(before))
    finally:
        os.sched_setaffinity(0, before)
