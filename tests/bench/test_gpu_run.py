"""The real-GPU procedure (bench/gpu) on real processes: scenarios against engines that are already
running, the managed fleet's config, and the supervisor killed-and-restarted test against a fleet
that kvgate launches itself (the simulator standing in for vLLM through tests/fake_vllm)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench import procs
from bench.cli import main
from bench.gpu import card, compare, host
from bench.report import write_reports
from bench.scenario import ExistingFleet, Fleet, FleetGroup, FleetSpec, run_scenario, scenario_from_dict
from gateway.config import load_config
from gateway.fleet.launcher import dry_run
from tests.conftest import STARTUP_S

REPO = Path(__file__).resolve().parents[2]
STUB = "tests.bench.stub_engine"


def shared_prefix_scenario(configs: list[dict[str, object]]) -> dict[str, object]:
    return {
        "name": "existing",
        "workload": "shared-prefix",
        # Simulator settings that must not matter: the engines already run.
        "fleet": {"model": "m", "profile": "h100x4-llama3.1-70b", "replicas": 7, "speedup": 0.1},
        "configs": configs,
        "sizes": {
            "quick": {
                "workload": {"groups": 3, "prompts_per_group": 4, "system_tokens": 256, "question_tokens": 16,
                             "output_tokens": 2},
                "loads": [{"concurrency": 1}],
            }
        },
    }  # fmt: skip


def records(out: Path, config: str) -> list[dict[str, object]]:
    path = out / "records" / f"{config}-C=1.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_runs_on_existing_engines_start_from_reset_caches(tmp_path: Path) -> None:
    spec = FleetSpec(replicas=2, model="m", profile="tiny", speedup=20)
    with Fleet(spec, tmp_path / "fleet", "existing").start() as fleet:
        scenario = scenario_from_dict(
            shared_prefix_scenario(
                [{"name": "first", "mode": "direct"}, {"name": "second", "mode": "direct"}]
            )
        )
        existing = ExistingFleet(fleet.urls, kind="sim")
        points = run_scenario(scenario, "quick", tmp_path / "out", progress=lambda m: None, existing=existing)
    assert [p.config for p in points] == ["first", "second"]
    for p in points:
        assert p.summary["ok"] == 12
        assert p.summary["fleet"]["prefix_cache_reset"] == dict.fromkeys(fleet.urls, "ok")
        assert p.summary["fleet"]["replicas"] == 2  # the engines given, not the scenario's seven
        # The first request of every group found nothing cached: the previous run left no warm prefix.
        firsts: dict[str, dict[str, object]] = {}
        for r in records(tmp_path / "out", p.config):
            if r["kind"] != "prime":
                firsts.setdefault(str(r["group"]), r)
        assert len(firsts) == 3 and all(int(r["cached_tokens"]) < 16 for r in firsts.values()), firsts  # type: ignore[call-overload]
    # Same requests in the same order from the same empty caches: the same hits, and each run's engine
    # counters count that run alone (a cumulative count would double).
    assert points[0].summary["cache_hit_rate"] == points[1].summary["cache_hit_rate"] > 0.3
    first, second = (p.summary["engine"] for p in points)
    assert second["prompt_tokens"] == pytest.approx(first["prompt_tokens"], rel=0.05)
    assert second["prefix_cache_hit_rate"] == pytest.approx(first["prefix_cache_hit_rate"], abs=0.02)

    # compare.py: the same steps' reports side by side (here the "simulator" is the same run).
    kg = tmp_path / "kg"
    write_reports(kg / "res" / "routing" / "all", "t", points, "first", {})
    (kg / "steps.jsonl").write_text(
        json.dumps({"step": "routing", "out": "routing/all", "rc": 0, "seconds": 1})
    )
    text = compare.render(kg, kg / "res")
    rows = [line for line in text.splitlines() if line.startswith(("| first", "| second"))]
    assert len(rows) == 2 and all(row.count("1.00") == 3 for row in rows), rows


def _run(config: str, mean: float, gpu: float, cpu: float) -> dict[str, object]:
    engine = {"prefix_cache_hits": gpu, "external_cache_hit_tokens": cpu, "recomputed_tokens": 100.0}
    return {
        "config": config,
        "load": "12 req/s",
        "ttft_ms": {"p50": mean, "p95": mean, "p99": mean, "mean": mean},
        "cache_hit_rate": 0.8,
        "throughput_rps": 12.0,
        "errors": {},
        "engine": {**engine, "cpu_loads": 7.0},
    }


def test_compare_shows_the_engines_tier_counters_the_failover_variants_and_the_card(tmp_path: Path) -> None:
    kg, sim = tmp_path / "kg", tmp_path / "sim"
    gpu_runs = {"tier_precise": (70.0, 300.0, 900.0), "tier_ignored": (100.0, 500.0, 100.0)}
    gpu_runs |= {"smg": (90.0, 600.0, 0.0)}
    steps = []
    for name, (mean, g, c) in gpu_runs.items():
        for root, factor in ((kg / "res", 1.0), (sim, 1.1)):
            out = root / "routing-tiers-gpu" / name
            out.mkdir(parents=True)
            (out / "report.json").write_text(json.dumps({"runs": [_run(name, mean * factor, g, c)]}))
        steps.append({"step": f"tiers_{name}", "out": f"routing-tiers-gpu/{name}", "rc": 0, "seconds": 1})
    for root in (kg / "res", sim):
        for variant, cut in (("failover_off", 12), ("failover_on", 0)):
            out = root / "failover-vllm" / variant
            out.mkdir(parents=True)
            doc = {"sent": 50, "completed": 50 - cut, "error": cut, "lost": 0, "failover": {"cut": cut}}
            (out / "report.json").write_text(json.dumps(doc))
    steps.append({"step": "failover_off", "out": "failover-vllm", "rc": 0, "seconds": 1})
    (kg / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (kg / "card.json").write_text(
        json.dumps({**dataclasses.asdict(card.CARDS["h100"]), "nvidia_smi": "H100, 81559"})
    )
    text = compare.render(kg, sim)
    assert text.startswith("# kvgate on an H100") and "model shape llama-3.2-3b" in text
    precise = next(line for line in text.splitlines() if line.startswith("| tier_precise | 70.0"))
    assert "| 300 | 900 | 100 | 7 |" in precise and precise.endswith("| 1.10 |")  # the sim's mean / the GPU's
    assert "| tier_precise mean TTFT <= 0.8 x tier_ignored | 0.70 | met |" in text
    assert "| tier_precise mean TTFT <= 1.0 x the best peer | 0.78 | met |" in text
    assert "| tier_precise: CPU hits a visible share of cached tokens (>= 10%) | 0.750 | met |" in text
    assert "| failover_off | GPU | 50 | 38 | 12 | 0 | 12 |" in text and "| failover_on | sim |" in text


def test_existing_engines_need_their_kv_events_for_precise_mode() -> None:
    with pytest.raises(ValueError, match="2 KV event endpoints for 1 engines"):
        ExistingFleet(["http://127.0.0.1:1"], ["tcp://127.0.0.1:2", "tcp://127.0.0.1:3"])
    without = ExistingFleet(["http://127.0.0.1:1/"])
    with pytest.raises(ValueError, match="give --kv-events"):
        without.attach(FleetSpec(kv_events=True))
    with_events = ExistingFleet(["http://127.0.0.1:1"], ["tcp://127.0.0.1:2"])
    assert with_events.attach(FleetSpec()).endpoints == [{"url": "http://127.0.0.1:1", "kind": "vllm"}]
    assert with_events.attach(FleetSpec(kv_events=True)).endpoints[0]["kv_events"] == "tcp://127.0.0.1:2"
    # With their replay sockets, the benchmark gateways ask there for batches they miss.
    replays = ExistingFleet(
        ["http://127.0.0.1:1"], ["tcp://127.0.0.1:2"], kv_events_replay=["tcp://127.0.0.1:3"]
    )
    assert replays.attach(FleetSpec(kv_events=True)).endpoints[0]["kv_events"] == {
        "endpoint": "tcp://127.0.0.1:2",
        "replay_endpoint": "tcp://127.0.0.1:3",
    }


def test_cli_endpoints_run_through_gateways_even_where_caches_cannot_be_reset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = shared_prefix_scenario([{"name": "gw", "pool": {"policy": {"type": "round_robin"}}}])
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    with Fleet(FleetSpec(module=STUB, replicas=2, model="m"), tmp_path / "logs", "stub").start() as fleet:
        argv = ["scenario", str(path), "--quick", "--out", str(tmp_path / "out"), "--endpoints", *fleet.urls]
        assert main([*argv, "--devices", "gpu:0", "-"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (run,) = report["runs"]
    assert run["ok"] == 12
    assert run["fleet"]["prefix_cache_reset"] == dict.fromkeys(fleet.urls, "unsupported (HTTP 404)")
    assert report["meta"]["fleet"].startswith(f"existing vllm engines {fleet.urls[0]}")
    gw = yaml.safe_load((tmp_path / "out" / "configs" / "gw.yaml").read_text())
    assert [e["url"] for e in gw["pools"][0]["endpoints"]] == fleet.urls
    assert [e.get("device") for e in gw["pools"][0]["endpoints"]] == ["gpu:0", None]
    assert main(["scenario", str(path), "--quick", "--kv-events", "tcp://127.0.0.1:1"]) == 2
    assert "--kv-events-replay, --devices and --roles go with --endpoints" in capsys.readouterr().err


def render_fleet(
    root: Path,
    base_port: int,
    gateway_port: int = 0,
    control_port: int = 0,
    template: str = "fleet.yaml.tmpl",
    card_name: str = "h200",
    **replace: str,
) -> Path:
    c = card.CARDS[card_name]
    path = root / "fleet.yaml"
    values = {"ROOT": str(root), "PORT": str(base_port), "KV_DTYPE": c.kv_cache_dtype}
    values |= {"KV_BYTES": str(c.kv_cache_memory_bytes), "OFFLOAD_GIB": str(c.tiers_offload_gib)}
    values["CUDART"] = str(root)
    card.render(REPO / "bench" / "gpu" / template, path, values)
    text = path.read_text()
    text = text.replace("port: 8100", f"port: {gateway_port}").replace("port: 8101", f"port: {control_port}")
    for old, new in replace.items():
        text = text.replace(old, new)
    path.write_text(text)
    return path


def test_the_kit_sizes_itself_to_the_card_and_its_templates_render_to_valid_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert card.detect("NVIDIA H100 80GB HBM3, 81559\n") == "h100"
    assert card.detect("NVIDIA H200, 143771\n") == "h200"
    # Every template renders to a config kvgate accepts, on either card, with nothing left unfilled.
    for name in ("h100", "h200"):
        for template in ("fleet.yaml.tmpl", "fleet_tiers.yaml.tmpl", "fleet_pd.yaml.tmpl"):
            settings = load_config(render_fleet(tmp_path, 8001, 8100, 8101, template, name))
            engines = settings.pools[0].engines
            assert engines is not None and engines.kv_cache_dtype == card.CARDS[name].kv_cache_dtype
    h100 = load_config(render_fleet(tmp_path, 8001, 8100, 8101, "fleet_tiers.yaml.tmpl", "h100"))
    line = next(x for x in dry_run(h100).splitlines() if x and not x.startswith("#"))
    assert "--kv-cache-memory-bytes 8589934592" in line and "--kv-offloading-size 12" in line
    assert "--kv-cache-dtype" not in line or "--kv-cache-dtype auto" in line  # BF16 on an H100
    # The model folder takes the card's shape: a 3B config on an H100, the 8B one kept beside it.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32}))
    kg = tmp_path / "kg"
    kg.mkdir()
    monkeypatch.setenv("KG_CARD", "h100")
    assert card.card_detect(kg, model) == 0
    config = json.loads((model / "config.json").read_text())
    shape = (config["hidden_size"], config["num_hidden_layers"], config["tie_word_embeddings"])
    assert shape == (3072, 28, True)
    assert json.loads((model / "config-8b.json").read_text())["hidden_size"] == 4096
    assert "CARD=h100" in (kg / "card.env").read_text()
    assert json.loads((kg / "card.json").read_text())["sim_profile"] == "h100-llama3.2-3b"
    with pytest.raises(SystemExit, match="unfilled"):
        card.render(REPO / "bench" / "gpu" / "fleet.yaml.tmpl", tmp_path / "x.yaml", {"ROOT": "/tmp"})


def test_the_gpu_fleet_config_launches_four_fp8_replicas_sharing_one_gpu(tmp_path: Path) -> None:
    base = procs.free_port_range(8)
    plan = dry_run(load_config(render_fleet(tmp_path, base)))
    (tmp_path / "dryrun.txt").write_text(plan)
    assert host.endpoints(tmp_path / "dryrun.txt", tmp_path / "endpoints.json") == 0
    eps = json.loads((tmp_path / "endpoints.json").read_text())
    assert eps["names"] == [f"h200-{i}" for i in range(4)]
    assert eps["urls"] == [f"http://127.0.0.1:{base + i}" for i in range(4)]
    assert len(set(eps["kv_events"])) == 4
    assert [e.replace("-replay", "") for e in eps["kv_events_replay"]] == eps[
        "kv_events"
    ]  # vLLM's replay sockets
    assert eps["devices"] == ["gpu:0"] * 4  # the benchmark gateways weigh the four as one GPU
    lines = [line for line in plan.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 4
    for line in lines:
        for part in (
            "CUDA_VISIBLE_DEVICES=0",
            "VLLM_SERVER_DEV_MODE=1",
            "VLLM_USE_FLASHINFER_SAMPLER=0",
            f"-m vllm.entrypoints.cli.main serve {tmp_path}/model",
            "--served-model-name meta-llama/Llama-3.1-8B-Instruct",
            "--kv-cache-dtype fp8",
            "--enable-chunked-prefill",
            "--enable-prefix-caching",
            "--kv-cache-memory-bytes 6227702579",
            "--gpu-memory-utilization 0.2",  # 0.8 split among the four sharers
            "--kv-events-config",
            "--load-format dummy",
        ):
            assert part in line, (part, line)


def test_served_rate_counts_the_whole_run_ramp_drain_and_failures_aside() -> None:
    ok = {"status": 200, "error": None}
    # 100 completions sent at 0, one every 0.1 s from 1 s, then a straggler at 20 s: the fleet
    # served 101 requests in 20 s, whatever pace it kept in the middle.
    recs = [{**ok, "sent": 0.0, "e2e": 1.0 + k * 0.1} for k in range(100)]
    recs.append({**ok, "sent": 0.0, "e2e": 20.0})
    failed = [{"status": 503, "error": "overloaded", "sent": 0.5, "e2e": 0.01}] * 30
    assert host.served_rate(recs + failed) == pytest.approx(101 / 20.0, rel=0.01)
    assert host.served_rate(recs[:5]) is None


def test_kill_test_a_launched_replica_is_restarted_and_rejoins(tmp_path: Path) -> None:
    kg = tmp_path / "kg"
    kg.mkdir()
    quick = {
        "startup_timeout_s: 420": "startup_timeout_s: 30",
        "replicas: 4": "replicas: 2",  # two simulators start faster than four; h200-1 is still there
        "gpu_ids: [[0], [0], [0], [0]]": "gpu_ids: [[0], [0]]",
    }
    port = procs.free_port_range(2)  # the gateway's and its control plane's
    cfg = render_fleet(tmp_path, procs.free_port_range(8), port, port + 1, **quick)
    settings = load_config(cfg)
    gateway = f"http://127.0.0.1:{settings.server.port}"
    control = f"http://127.0.0.1:{settings.control.port}"
    (kg / "launch_dryrun_fp8.txt").write_text(dry_run(settings))
    assert host.endpoints(kg / "launch_dryrun_fp8.txt", kg / "endpoints.json") == 0
    (kg / "admin_key").write_text("test-admin-key")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3 = this venv's
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "fake_vllm"), str(REPO)]),
        "KVGATE_CONTROL__ADMIN_KEY": "test-admin-key",
        "FAKE_VLLM_STARTUP_S": "0.5",
    }
    log = (kg / "gateway_fp8.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=kg,
        start_new_session=True,
    )
    try:
        deadline = time.time() + STARTUP_S
        while len([r for r in host.admin_pools(control, kg).values() if r["healthy"]]) < 2:
            assert proc.poll() is None and time.time() < deadline, (kg / "gateway_fp8.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        opts = argparse.Namespace(
            control=control,
            warm_s=2.0,
            max_s=40.0,
            after_s=1.5,
            system_tokens=256,
            output_tokens=32,
            tag="fp8",
            name="kill_restart",
        )
        result = host.run_sync_kill(kg, gateway, "h200-1", 8.0, opts)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert result["gateway_routes_again_s"] is not None, result
    assert result["traffic_off_s"] >= 0
    # The supervisor saw the exit and took the replica out itself, not its failing health checks.
    assert "managed replica h200-1 went down" in (kg / "gateway_fp8.log").read_text()
    assert result["traffic_off_s"] <= result["gateway_routes_again_s"]
    # The monitor polls every 0.25 s: the gateway may route to the victim a moment before it looks.
    assert result["first_request_served_again_s"] >= result["gateway_routes_again_s"] - 1.0
    assert result["sent_to_victim_while_out"] == 0, result
    # Only what the victim was serving at the kill may fail; everything sent later succeeds.
    assert result["failed_after_traffic_off"] == 0, result
    assert result["ok"] + result["in_flight_at_kill_failed"] == result["requests"], result
    assert (kg / "res" / "kill_restart" / "timeline.jsonl").stat().st_size > 0
    shutil.rmtree(tmp_path / "kg" / "engines", ignore_errors=True)


def test_existing_engines_play_the_roles_they_were_launched_in() -> None:
    urls = [f"http://127.0.0.1:{p}" for p in (1, 2, 3, 4)]
    fleet = ExistingFleet(urls, roles=["prefill", "decode", "prefill", "decode"])
    split = FleetSpec(groups=[FleetGroup(1, "prefill"), FleetGroup(1, "decode")])
    assert fleet.attach(split).endpoints == [
        {"url": urls[0], "kind": "vllm", "role": "prefill"},
        {"url": urls[1], "kind": "vllm", "role": "decode"},
    ]
    assert [e["url"] for e in fleet.attach(FleetSpec(replicas=2)).endpoints] == urls[:2]
    assert all("role" not in e for e in fleet.attach(FleetSpec(replicas=4)).endpoints)
    with pytest.raises(ValueError, match="3 decode replicas wanted, 2 engines left"):
        fleet.attach(FleetSpec(groups=[FleetGroup(3, "decode")]))
    with pytest.raises(ValueError, match="needs --roles"):
        ExistingFleet(urls).attach(split)
