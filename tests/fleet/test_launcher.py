"""FleetLauncher with real processes: readiness, crash and restart, clean stop, no orphans."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import EngineSpec, Settings
from gateway.fleet.engines import adapter_for_spec, get_adapter
from gateway.fleet.launcher import FleetLauncher, LaunchedReplica, LaunchError, dry_run
from gateway.fleet.load_scraper import LoadScraper
from gateway.logs import TextFormatter
from tests.conftest import PYTHON, REPO, STARTUP_S, free_port, subprocess_env, wait_until, wait_until_sync
from tests.test_lifecycle import kvgate


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Recorder:
    def __init__(self) -> None:
        self.ready: list[LaunchedReplica] = []
        self.down: list[str] = []

    async def on_ready(self, replica: LaunchedReplica) -> None:
        self.ready.append(replica)

    def on_down(self, name: str) -> None:
        self.down.append(name)


def fast_spec(tmp_path: Path, **kw: object) -> EngineSpec:
    base: dict[str, object] = {
        "kind": "sim",
        "startup_timeout_s": STARTUP_S,
        "restart_backoff_s": 0.1,
        "restart_backoff_max_s": 0.4,
        "stop_grace_s": 3,
        "log_dir": str(tmp_path / "logs"),
    }
    return EngineSpec(**(base | kw))  # type: ignore[arg-type]


async def test_three_simulators_crash_restart_and_clean_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder()
    # --startup-delay: the simulator answers 503 for a while, like an engine loading weights.
    spec = fast_spec(
        tmp_path, replicas=3, kv_cache_dtype="fp8", sim={"extra_args": ["--startup-delay", "0.3"]}
    )
    launcher = FleetLauncher(
        "pool", spec, "meta-llama/Llama-3.1-8B-Instruct", rec.on_ready, rec.on_down, progress_every_s=0.1
    )
    caplog.set_level(logging.INFO, logger="kvgate.launcher")
    await launcher.start()
    try:
        replicas = await launcher.wait_ready(timeout_s=STARTUP_S)
        assert sorted(r.name for r in replicas) == ["pool-0", "pool-1", "pool-2"]
        assert len({r.url for r in replicas}) == 3
        assert sorted(r.name for r in rec.ready) == ["pool-0", "pool-1", "pool-2"]
        assert re.search(r"replica pool-\d still starting \(\d+ s\)", caplog.text)
        scraper = LoadScraper()
        for r in replicas:
            scraper.add(r.name, r.url, get_adapter("sim"))
        await scraper.start()
        try:
            for r in replicas:
                load = await scraper.scrape_once(r.name)
                assert load is not None and load.block_size == 16 and load.num_gpu_blocks
        finally:
            await scraper.stop()
        first = {r.name: r for r in replicas}

        os.kill(first["pool-1"].pid, signal.SIGKILL)
        await wait_until(lambda: rec.down == ["pool-1"], timeout=15.0)
        await wait_until(lambda: len(rec.ready) == 4, timeout=STARTUP_S)
        back = rec.ready[-1]
        assert back.name == "pool-1" and back.url == first["pool-1"].url
        assert back.pid != first["pool-1"].pid
        assert launcher.status()["pool-1"].restarts == 1
        assert (tmp_path / "logs" / "pool-1.log").read_text().count("kvgate starting pool-1") == 2
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(back.url + "/health")).status_code == 200
        pids = [r.pid for r in rec.ready]
    finally:
        await launcher.stop()
    assert not [pid for pid in pids if alive(pid)]
    assert rec.down == ["pool-1"]  # stopping is not a crash
    assert all(s.state == "stopped" for s in launcher.status().values())


async def test_sglang_speaking_simulators_in_pd_roles(tmp_path: Path) -> None:
    spec = fast_spec(
        tmp_path, replicas=2, roles={"prefill": 1, "decode": 1}, sim={"extra_args": ["--api", "sglang"]}
    )
    launcher = FleetLauncher("sg", spec, "m", lambda r: None, lambda n: None)
    await launcher.start()
    try:
        prefill, decode = sorted(await launcher.wait_ready(timeout_s=STARTUP_S), key=lambda r: r.name)
        assert (prefill.role, decode.role) == ("prefill", "decode")
        assert prefill.bootstrap_port is not None and decode.bootstrap_port is None
        # The prefill replica listens on its bootstrap port, as SGLang's does.
        _, writer = await asyncio.open_connection("127.0.0.1", prefill.bootstrap_port)
        writer.close()
        scraper = LoadScraper()
        scraper.add(prefill.name, prefill.url, adapter_for_spec(spec))
        await scraper.start()
        try:
            load = await scraper.scrape_once(prefill.name)  # /v1/loads JSON
            assert load is not None and (load.running, load.waiting) == (0, 0)
        finally:
            await scraper.stop()
    finally:
        await launcher.stop()


async def test_failed_start_reports_log_tail(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = fast_spec(tmp_path, sim={"profile": "no-such-gpu"})  # the simulator refuses to start
    rec = Recorder()
    launcher = FleetLauncher("bad", spec, "tiny", rec.on_ready, rec.on_down)
    caplog.set_level(logging.INFO, logger="kvgate.launcher")
    await launcher.start()
    try:
        with pytest.raises(LaunchError) as err:
            await launcher.wait_ready(timeout_s=STARTUP_S)
    finally:
        await launcher.stop()
    message = str(err.value)
    assert "bad-0" in message and "exited with code 2 while starting" in message
    assert "invalid choice: 'no-such-gpu'" in message  # the engine's own words, from its log
    # And in the gateway log, line by line (not one line with its newlines escaped as `\n`).
    (failed,) = [r for r in caplog.records if "exited with code 2" in r.getMessage()]
    logged = TextFormatter().format(failed).splitlines()
    assert len(logged) > 2 and all(line.startswith("    | ") for line in logged[1:])
    assert any("invalid choice: 'no-such-gpu'" in line for line in logged[1:])
    assert rec.ready == [] and rec.down == []


async def test_readiness_timeout_kills_the_replica(tmp_path: Path) -> None:
    hang = "import time; print('compiling graphs', flush=True); time.sleep(600)"
    spec = fast_spec(
        tmp_path, command=[sys.executable, "-c", hang], startup_timeout_s=0.5, restart_backoff_s=5
    )
    rec = Recorder()
    launcher = FleetLauncher("slow", spec, "tiny", rec.on_ready, rec.on_down)
    await launcher.start()
    try:
        with pytest.raises(LaunchError, match=r"not ready after 0.5 s[\s\S]*compiling graphs"):
            await launcher.wait_ready(timeout_s=STARTUP_S)
        pid = launcher.status()["slow-0"].pid
        assert pid is not None and not alive(pid)  # killed before the restart backoff
    finally:
        await launcher.stop()


def _not_executable(tmp_path: Path) -> str:
    path = tmp_path / "vllm"
    path.write_text("#!/bin/sh\n")
    return str(path)


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        (  # the case: reported as `[Errno 2] No such file or directory` and retried forever
            lambda tmp: {"kind": "vllm", "env": {"PATH": str(tmp)}},
            "`vllm` not found on PATH: set engines.command or install vLLM",
        ),
        (
            lambda tmp: {
                "kind": "sglang",
                "command": [str(tmp / "venv" / "bin" / "python3"), "-m", "sglang"],
            },
            "`{tmp}/venv/bin/python3` does not exist: set engines.command or install SGLang",
        ),
        (
            lambda tmp: {"kind": "vllm", "command": [_not_executable(tmp), "serve"]},
            "`{tmp}/vllm` is not executable: set engines.command or install vLLM",
        ),
        (  # this interpreter, which answers for itself
            lambda tmp: {"command": [sys.executable, "-m", "no_such_engine.server"]},
            f"`{sys.executable}` cannot import no_such_engine (for `-m no_such_engine.server`): "
            "set engines.command",
        ),
        (  # another module path: that interpreter is asked, as a process of its own
            lambda tmp: {
                "command": [sys.executable, "-m", "no_such_engine"],
                "env": {"PYTHONPATH": str(tmp)},
            },
            f"`{sys.executable}` cannot import no_such_engine (for `-m no_such_engine`): set engines.command",
        ),
    ],
)
async def test_an_engine_that_cannot_start_is_named_and_not_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, engines: Any, expected: str
) -> None:
    spec = fast_spec(tmp_path, **engines(tmp_path))
    launcher = FleetLauncher("gpu", spec, "m", lambda r: None, lambda n: None)
    caplog.set_level(logging.INFO, logger="kvgate.launcher")
    await launcher.start()
    try:
        with pytest.raises(LaunchError) as err:
            await launcher.wait_ready(timeout_s=STARTUP_S)
    finally:
        await launcher.stop()
    message = expected.replace("{tmp}", str(tmp_path))
    assert str(err.value) == f"gpu-0: replica gpu-0 cannot be started: {message}"
    status = launcher.status()["gpu-0"]
    assert status.restarts == 0 and status.pid is None  # never spawned, never retried
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"replica gpu-0 cannot be started: {message}; not retried (fix it, then restart the gateway)"
    ]
    assert "restarting replica" not in caplog.text


DRIVER = textwrap.dedent(
    """
    import asyncio, sys
    from gateway.config import EngineSpec
    from gateway.fleet.launcher import FleetLauncher

    async def main():
        spec = EngineSpec(kind="sim", replicas=2, log_dir=sys.argv[1])
        launcher = FleetLauncher("orphan", spec, "tiny", lambda r: None, lambda n: None)
        await launcher.start()
        replicas = await launcher.wait_ready(float(sys.argv[2]))
        print(" ".join(str(r.pid) for r in replicas), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


async def test_engines_die_when_the_gateway_is_killed(tmp_path: Path) -> None:
    gateway = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "logs"), str(STARTUP_S)],
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )
    pids: list[int] = []
    try:
        assert gateway.stdout is not None
        pids += [int(p) for p in (await asyncio.to_thread(gateway.stdout.readline)).split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        gateway.kill()  # no chance to stop its engines
        gateway.wait()
        await wait_until(lambda: not any(alive(p) for p in pids), timeout=10)
    finally:
        gateway.kill()
        gateway.wait()
        for pid in pids:  # only if the assertion above failed: do not leave them behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_dry_run_renders_a_vllm_pd_fleet() -> None:
    settings = Settings(
        pools=[
            {
                "name": "llama-pd",
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "engines": {
                    "kind": "vllm",
                    "replicas": 3,
                    "roles": {"prefill": 1, "decode": 2},
                    "kv_cache_dtype": "fp8",
                    "chunked_prefill": {"max_num_batched_tokens": 8192},
                    "kv_events": True,
                },
            },
            {"name": "remote", "model": "m", "endpoints": [{"url": "http://10.0.0.5:8000"}]},
        ]
    )
    text = dry_run(settings)
    lines = text.splitlines()
    assert (
        lines[0] == "# pool llama-pd: 3 x vllm (prefill 1, decode 2), model meta-llama/Llama-3.1-8B-Instruct"
    )
    commands = [line for line in lines if line and not line.startswith("#")]
    assert len(commands) == 3
    assert commands[0].startswith("CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 ")
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct --host 127.0.0.1" in commands[0]
    config = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":"recompute"}'
    assert f"--kv-transfer-config '{config}'" in commands[0]
    assert "kv_consumer" in commands[1] and "kv_consumer" in commands[2]
    events = [json.loads(c.split("--kv-events-config ")[1].split("'")[1])["endpoint"] for c in commands]
    assert len(set(events)) == 3
    assert "remote" not in text


def test_dry_run_shows_the_ports_serve_uses(tmp_path: Path) -> None:
    """Without `engines.base_port`, `kvgate launch --dry-run` printed different free ports every run,
    so the lines reviewed were not the lines that ran. Now two dry runs agree, and `kvgate serve`
    launches its engines on exactly those ports."""
    port, control = free_port(), free_port()
    engines = {"kind": "sim", "replicas": 2, "log_dir": str(tmp_path / "logs"), "sim": {"profile": "tiny"}}
    doc = {
        "server": {"port": port},
        "control": {"port": control, "admin_key": "k"},
        "pools": [{"name": "sim", "model": "m", "policy": {"type": "round_robin"}, "engines": engines}],
    }
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump(doc))
    first, second = (kvgate("launch", str(config), "--dry-run") for _ in range(2))
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    planned = re.findall(r"url=(\S+)", first.stdout)
    assert len(planned) == 2 and all(int(url.rsplit(":", 1)[1]) >= port + 100 for url in planned)
    serve = subprocess.Popen(
        [PYTHON, "-m", "gateway", "serve", "--config", str(config)],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:

        def launched() -> list[str] | None:
            assert serve.poll() is None, "kvgate serve exited"
            try:
                pools = httpx.get(
                    f"http://127.0.0.1:{control}/admin/pools", headers={"authorization": "Bearer k"}
                ).json()["pools"]
            except httpx.TransportError:
                return None
            urls = sorted(r["url"] for r in pools["sim"]["replicas"].values())
            return urls if len(urls) == 2 else None

        assert wait_until_sync(launched, STARTUP_S, "both replicas to join", 0.2) == sorted(planned)
    finally:
        serve.terminate()
        serve.wait(timeout=60)


def test_the_memory_split_of_a_shared_gpu_is_the_one_documented() -> None:
    """docs/engines.md's example: four replicas on GPU 0 share the engine's default fraction."""
    on_gpu0 = {"replicas": 4, "gpu_ids": [[0], [0], [0], [0]]}
    settings = Settings(
        pools=[
            {"name": "v", "model": "m", "engines": {"kind": "vllm", **on_gpu0}},
            {"name": "s", "model": "n", "engines": {"kind": "sglang", **on_gpu0}},
        ]
    )
    flags = re.findall(r"--(?:gpu-memory-utilization|mem-fraction-static) \S+", dry_run(settings))
    assert flags == ["--gpu-memory-utilization 0.23"] * 4 + ["--mem-fraction-static 0.22"] * 4
    doc = " ".join((REPO / "docs" / "engines.md").read_text().split())
    assert "vLLM 0.92: four replicas on GPU 0 get `--gpu-memory-utilization 0.23` each" in doc
    assert "SGLang `--mem-fraction-static`, 0.88: 0.22" in doc


async def test_restart_backoff_doubles_up_to_the_cap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = fast_spec(tmp_path, command=[sys.executable, "-c", "raise SystemExit(1)"], restart_backoff_s=0.05)
    caplog.set_level(logging.INFO, logger="kvgate.launcher")
    launcher = FleetLauncher("loop", spec, "tiny", lambda r: None, lambda n: None)
    await launcher.start()
    try:
        await wait_until(lambda: launcher.status()["loop-0"].restarts >= 5, timeout=15.0)
    finally:
        await launcher.stop()
    delays = [
        r.getMessage().rsplit(" in ", 1)[1] for r in caplog.records if "restarting replica" in r.getMessage()
    ]
    assert delays[:5] == ["0.05 s", "0.10 s", "0.20 s", "0.40 s", "0.40 s"]
