"""Scenarios end to end: real child processes (stub engines, the simulator, the gateway), report files."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from bench import procs
from bench.cli import main
from bench.faults import ACTIONS, FaultScenario, fault_scenario_from_dict
from bench.scenario import (
    FleetSpec,
    available_scenarios,
    deep_merge,
    load_scenario,
    load_spec,
    run_scenario,
    scenario_from_dict,
)
from bench.workloads import make_workload

STUB = "tests.bench.stub_engine"


def table_rows(printed: str) -> list[list[str]]:
    """The cells of every table row printed to the terminal."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in printed.splitlines()
            if line.startswith("| ")]  # fmt: skip


def stub_scenario(configs: list[dict[str, object]]) -> dict[str, object]:
    return {
        "name": "stub",
        "workload": "shared-prefix",
        "fleet": {"module": STUB, "replicas": 2, "model": "m", "startup_timeout_s": 30},
        "configs": configs,
        "sizes": {
            "quick": {
                "workload": {"groups": 2, "prompts_per_group": 4, "system_tokens": 64, "output_tokens": 4},
                "loads": [{"rate": 40}, {"concurrency": 2}],
            }
        },
    }


def test_builtin_scenarios_are_valid() -> None:
    names = available_scenarios()
    assert {"routing", "overhead", "scheduling"} <= set(names)
    for name in names:
        scenario = load_scenario(name)
        assert {"quick", "full"} <= set(scenario.sizes), name
        if isinstance(scenario, FaultScenario):
            continue  # a fault schedule, validated as it loads
        for size_name, size in scenario.sizes.items():
            make_workload(scenario.workload, size.workload)  # parameters exist
            assert size.loads, (name, size_name)
            for point in size.loads:
                load_spec(point, size, scenario.seed)
            known = {c.name for c in scenario.configs}
            assert set(size.configs or known) <= known, (name, size_name)


def test_deep_merge_and_baseline_validation() -> None:
    base = {"a": {"b": 1, "c": [1]}, "d": 2}
    assert deep_merge(base, {"a": {"c": [2], "e": 3}}) == {"a": {"b": 1, "c": [2], "e": 3}, "d": 2}
    assert base == {"a": {"b": 1, "c": [1]}, "d": 2}
    with pytest.raises(ValueError, match="baseline 'nope'"):
        scenario_from_dict({**stub_scenario([{"name": "x", "mode": "direct"}]), "baseline": "nope"})
    with pytest.raises(ValueError, match=r"scenario 'stub': .*'polcy'"):
        scenario_from_dict(stub_scenario([{"name": "x", "polcy": {}}]))
    scenario = scenario_from_dict(stub_scenario([{"name": "x", "mode": "direct"}]))
    with pytest.raises(ValueError, match=r"unknown keys \['rps'\]"):
        load_spec({"rps": 3}, scenario.size("quick"), 0)


def test_fleet_children_are_stopped_and_failures_name_the_log(tmp_path: Path) -> None:
    from bench.scenario import Fleet

    fleet = Fleet(FleetSpec(module=STUB, replicas=2, model="m"), tmp_path, "t").start()
    procs_started = [c.proc for c in fleet.children]
    assert all(p is not None and p.poll() is None for p in procs_started)
    port = int(fleet.urls[0].rsplit(":", 1)[1])
    fleet.stop()
    assert all(p is not None and p.poll() is not None for p in procs_started)
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
        socket.create_connection((procs.HOST, port), timeout=2).close()

    broken = Fleet(FleetSpec(module="bench.no_such_module", model="m"), tmp_path, "broken")
    with pytest.raises(procs.ProcessError, match="exited with code 1") as info:
        broken.start()
    assert "No module named" in str(info.value)
    assert all(c.proc is not None and c.proc.poll() is not None for c in broken.children)


def test_stub_fleet_direct_vs_gateway_reports(tmp_path: Path) -> None:
    scenario = scenario_from_dict(
        stub_scenario(
            [
                {"name": "direct", "mode": "direct"},
                {"name": "gw", "pool": {"policy": {"type": "round_robin"}}},
            ]
        )
    )
    points = run_scenario(scenario, "quick", tmp_path, progress=lambda m: None)
    assert [(p.config, p.load) for p in points] == [
        ("direct", "40 req/s"),
        ("direct", "C=2"),
        ("gw", "40 req/s"),
        ("gw", "C=2"),
    ]
    for p in points:
        assert p.summary["ok"] == 8, p.summary["errors"]
        assert len(p.ttft_ms) == 8
        assert p.summary["cache_hit_rate"] > 0  # the stub caches 16-token blocks of the shared prompts
    assert set(points[0].summary["requests_per_replica"]) == {
        u for u in points[0].summary["requests_per_replica"]
    }
    assert all(name.startswith("http://127.0.0.1:") for name in points[0].summary["requests_per_replica"])
    gw_config = (tmp_path / "configs" / "gw.yaml").read_text()
    assert "round_robin" in gw_config and "127.0.0.1" in gw_config
    assert len(list((tmp_path / "records").glob("*.jsonl"))) == 4


def test_quick_sim_scenario_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The built-in overhead scenario's shape, pinned here so that retuning the YAML cannot break it.
    scenario = {
        "name": "overhead",
        "workload": "prefix-repetition",
        "baseline": "direct",
        "fleet": {"profile": "h200-llama3.1-8b", "replicas": 2},
        "configs": [
            {"name": "direct", "mode": "direct"},
            {"name": "gateway_prefix", "pool": {"policy": {"type": "prefix_affinity"}}},
        ],
        "sizes": {
            "quick": {
                "workload": {"num_prefixes": 4, "prefix_tokens": 256, "suffix_tokens": 32,
                             "output_tokens": 16, "num_requests": 60},
                "loads": [{"concurrency": 4}],
            }
        },
    }  # fmt: skip
    path = tmp_path / "overhead.yaml"
    path.write_text(yaml.safe_dump(scenario))
    assert main(["scenario", str(path), "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = table_rows(printed)
    assert [r[:3] for r in rows[1:]] == [["direct", "C=4", "60/60"], ["gateway_prefix", "C=4", "60/60"]]
    assert rows[1][5] == "x1.00 / x1.00"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["baseline"] == "direct"
    assert [r["config"] for r in report["runs"]] == ["direct", "gateway_prefix"]
    for run in report["runs"]:
        assert run["ok"] == run["requests"] == 60
        assert run["ttft_ms"]["p50"] > 0 and run["output_tokens"] == 60 * 16
        assert run["cache_hit_rate"] > 0.3  # four 256-token prefixes repeated 60 times
        # The engines' own counters: every measured output token was generated (plus priming).
        assert run["engine"]["generation_tokens"] >= 60 * 16
        assert 0 < run["engine"]["prefix_cache_hit_rate"] < 1
    # kvgate's index said what the engines found (no gateway, nothing to check).
    agreement = {r["config"]: r.get("kv_agreement") for r in report["runs"]}
    assert agreement["direct"] is None and agreement["gateway_prefix"]["gpu"]["agrees"], agreement
    md = (tmp_path / "report.md").read_text()
    assert md.count("x1.00") >= 3 and "Engines' own counters" in md
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000


def test_cli_run_against_running_engines_with_a_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.scenario import Fleet

    with Fleet(FleetSpec(module=STUB, replicas=2, model="m"), tmp_path / "logs", "cli").start() as fleet:
        argv = [
            "run",
            "--workload",
            "prefix-repetition",
            "--set",
            "num_requests=10",
            "--set",
            "prefix_tokens=32",
        ]
        argv += [
            "--model",
            "m",
            "--header",
            "x-stub-itl-ms: 1",
            "--rate",
            "50",
            "--rate",
            "100",
            "--out",
            str(tmp_path / "out"),
        ]
        for url in fleet.urls:
            argv += ["--target", url]
        assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [r[:3] for r in table_rows(out)[1:]]
    assert rows == [["target", "50 req/s", "10/10"], ["target", "100 req/s", "10/10"]]
    assert (tmp_path / "out" / "ttft_p95_vs_load.png").exists()
    assert (tmp_path / "out" / "ttft_cdf.png").exists()


def test_cli_reports_unreachable_target(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.conftest import free_port

    argv = [
        "run",
        "--workload",
        "prefix-repetition",
        "--rate",
        "10",
        "--target",
        f"http://127.0.0.1:{free_port()}",
    ]
    assert main(argv) == 2
    assert "priming request" in capsys.readouterr().err


def test_a_failing_config_is_reported_and_the_others_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = {"name": "broken", "pool": {"policy": {"type": "no_such_policy"}}}
    data = stub_scenario([{"name": "direct", "mode": "direct"}, broken])
    data["sizes"]["quick"]["loads"] = [{"rate": 40}]  # type: ignore[index]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["scenario", str(path), "--quick", "--out", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "FAILED: broken @ 40 req/s: gateway broken exited with code" in captured.err
    assert "no_such_policy" in captured.out  # the tail of its log, printed when it failed
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [r["config"] for r in report["runs"]] == ["direct"]
    assert "broken @ 40 req/s" in report["meta"]["FAILED"]


async def test_a_fleet_with_kv_events_names_each_replicas_own_publisher(tmp_path: Path) -> None:
    import httpx

    from bench.scenario import Fleet
    from gateway.routing.kv_events import KVEventIndexer, KVEventSubscriber, TokenBlockHasher
    from gateway.routing.prefix_index import PrefixIndex

    spec = FleetSpec(replicas=2, model="m", profile="tiny", speedup=20, kv_events=True)
    with Fleet(spec, tmp_path, "kv").start() as fleet:
        publishers = [e["kv_events"] for e in fleet.endpoints]
        assert len(set(publishers)) == 2
        index = PrefixIndex()
        indexer = KVEventIndexer(index, TokenBlockHasher(16, "m"))
        subs = [KVEventSubscriber(p, f"r{i}", indexer) for i, p in enumerate(publishers)]
        for sub in subs:
            sub.start()
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                # New prompts until the events flow: a SUB socket misses what was sent before it joined.
                for attempt in range(200):
                    prompt = f"attempt {attempt}: " + "the tide tables of the North Sea " * 20
                    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
                    r = await c.post(fleet.urls[1] + "/v1/completions", json=body)
                    assert r.status_code == 200
                    if indexer.stats.stored:
                        break
            held = {name: s["blocks"] for name, s in index.stats()["replicas"].items()}
            assert held.get("r1", 0) > 0 and held.get("r0", 0) == 0, held
        finally:
            for sub in subs:
                sub.close()


def test_fault_schedules_are_checked_as_they_load() -> None:
    faults = load_scenario("faults")
    assert isinstance(faults, FaultScenario)
    assert {s.action for s in faults.size("full").faults} == set(ACTIONS)
    data = {"name": "f", "kind": "faults", "sizes": {"quick": {"duration_s": 10, "faults": []}}}
    for bad, match in (
        ({"at": 1, "action": "explode"}, "unknown action"),
        ({"at": 1, "action": "kill", "replica": 9}, "needs replica"),
        ({"at": 11, "action": "kill_redis"}, "outside the run"),
    ):
        data["sizes"]["quick"]["faults"] = [bad]  # type: ignore[index]
        with pytest.raises(ValueError, match=match):
            fault_scenario_from_dict(data)
