"""Every example config in config/ works as shipped: `kvgate check-config` accepts it, `kvgate serve`
starts it (real engines replaced by simulated ones, on free ports) and says when it is ready, each
of its models answers, and the commands its comments tell a user to run succeed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.sim.cli import build_parser
from tests.conftest import PYTHON, REPO, STARTUP_S, free_port, subprocess_env, wait_until_sync
from tests.simfleet import sim_fleet

EXAMPLES = sorted((REPO / "config").glob("*.yaml"))
READY = re.compile(r"kvgate ready on (\S+): (\d+) healthy replica")
# A command a comment tells the user to run: indented after `#`, after a colon, or in backticks.
COMMAND = re.compile(r"(?:^#\s{2,}|:\s{2,}|`)((?:kvgate|curl) [^`\n]*)")


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_passes_check_config(path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "gateway", "check-config", str(path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def commands(path: Path) -> list[str]:
    """The shell commands in the file's comments, continuation lines joined."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(lines).replace("\\\n#", " ")
    return [m.group(1).strip() for line in text.splitlines() if (m := COMMAND.search(line))]


def runnable(doc: dict[str, Any], stack: ExitStack, logs: Path) -> dict[str, Any]:
    """The config on free ports, ready when all its pools are, with simulated engines: managed vLLM
    and SGLang pools launch the simulator instead (one replica a role, to keep the suite quick);
    endpoints point at simulators started here; shared state stays in memory."""
    # Ready (and so the ready line) only when every pool is: each model is asked for below.
    doc["server"] = {**doc.get("server", {}), "host": "127.0.0.1", "port": free_port(), "ready": "all"}
    doc["control"] = {**doc.get("control", {}), "host": "127.0.0.1", "port": free_port()}
    doc["control"].setdefault("admin_key", "example-test")
    doc["state"] = {"backend": "memory"}
    for pool in doc["pools"]:
        spec = pool.get("engines")
        if spec is not None:
            sim = spec.setdefault("sim", {})
            if spec["kind"] == "sglang":
                sim["extra_args"] = [*sim.get("extra_args", []), "--api", "sglang"]
            spec.update(kind="sim", replicas=2 if spec.get("roles") else 1, log_dir=str(logs))
            if spec.get("roles"):
                spec["roles"] = {"prefill": 1, "decode": 1}
            spec.pop("gpu_ids", None)
            continue
        eps = pool.get("endpoints", [])
        extra = ["--api", "sglang"] if any(ep.get("kind") == "sglang" for ep in eps) else []
        model = pool.get("served_model") or pool["model"]
        fleet = stack.enter_context(sim_fleet(*extra, replicas=len(eps), model=model))
        for ep, url in zip(eps, fleet.urls, strict=True):
            ep["url"] = url
    return doc


@contextmanager
def serving(config: Path, log: Path) -> Iterator[str]:
    """`kvgate serve --config config`, yielded once it logs that it is ready: its URL."""
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [PYTHON, "-m", "gateway", "serve", "--config", str(config)],
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=REPO,
        )
    try:

        def ready() -> re.Match[str] | None:
            assert proc.poll() is None, log.read_text()[-3000:]
            return READY.search(log.read_text(errors="replace"))

        yield wait_until_sync(ready, STARTUP_S, f"{config.name} to log that it is ready", 0.1).group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def models(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(model, endpoint path) for every route and pool model, as a client would ask for it."""
    pools = {p["name"]: p for p in doc["pools"]}
    out = [(r["model"], _path(pools[r["rules"][-1]["pools"][0]["name"]])) for r in doc.get("routes", [])]
    return out + [(p["model"], _path(p)) for p in doc["pools"]]


def _path(pool: dict[str, Any]) -> str:
    return "/v1/embeddings" if "generate" not in pool.get("tasks", ["generate"]) else "/v1/chat/completions"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_serves_and_its_commands_run(path: Path, tmp_path: Path) -> None:
    original = yaml.safe_load(path.read_text())
    with ExitStack() as stack:
        doc = runnable(yaml.safe_load(path.read_text()), stack, tmp_path / "engines")
        config = tmp_path / path.name
        config.write_text(yaml.safe_dump(doc))
        with serving(config, tmp_path / "serve.log") as url:
            with httpx.Client(base_url=url, timeout=60) as client:
                assert client.get("/ready").status_code == 200  # ready when it said so
                for model, endpoint in models(doc):
                    body: dict[str, Any] = {"model": model, "max_tokens": 2}
                    if endpoint == "/v1/embeddings":
                        body = {"model": model, "input": "a garden rake"}
                    else:
                        body["messages"] = [{"role": "user", "content": "hi"}]
                    r = client.post(endpoint, json=body)
                    assert r.status_code == 200, (model, r.text)
            bin_dir = kvgate_on_path(tmp_path)
            for command in commands(path):
                run_command(command, path, original, doc, bin_dir)


def run_command(
    command: str, path: Path, original: dict[str, Any], doc: dict[str, Any], bin_dir: Path
) -> None:
    """Run one of the comments' commands through a shell, as a user would (`kvgate` on PATH, $ADMIN
    set to the admin key), against the ports this test serves on."""
    if command.startswith("kvgate serve"):
        # Serving it is what the test just did; a command that names a config names this one.
        assert "--config" not in command or f"--config config/{path.name}" in command
        return
    if command.startswith("kvgate sim "):
        return  # its engines: started on free ports by runnable(), checked by the test below
    ports = {
        original.get("server", {}).get("port", 8000): doc["server"]["port"],
        original.get("control", {}).get("port", 9001): doc["control"]["port"],
    }
    for old, new in ports.items():
        command = re.sub(rf"\b(localhost|127\.0\.0\.1):{old}\b", rf"\g<1>:{new}", command)
    env = subprocess_env()
    env |= {"ADMIN": str(doc["control"]["admin_key"]), "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}
    done = subprocess.run(
        ["sh", "-c", command], env=env, cwd=REPO, capture_output=True, text=True, timeout=STARTUP_S
    )
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    assert '"error"' not in done.stdout, (command, done.stdout[-2000:])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_says_how_to_start_the_engines_it_expects_on_this_host(path: Path) -> None:
    """Each endpoint on this host that nothing in the config launches: a simulator command in the
    comments serves the model name its pool asks for on its port, with flags the simulator takes."""
    doc = yaml.safe_load(path.read_text())
    wanted = {
        (int(url.port or 80), pool.get("served_model") or pool["model"])
        for pool in doc["pools"]
        for ep in pool.get("endpoints", [])
        if (url := httpx.URL(ep["url"])).host in ("127.0.0.1", "localhost")
    }
    started = set()
    for command in commands(path):
        if command.startswith("kvgate sim "):
            args, unknown = build_parser().parse_known_args(shlex.split(command)[2:])
            assert not unknown, (command, unknown)
            names = args.served_model_name or [args.model]
            started |= {(args.port + i, name) for i in range(args.replicas) for name in names}
    assert wanted <= started, f"{path.name}: no `kvgate sim` command in its comments for {wanted - started}"


def kvgate_on_path(tmp_path: Path) -> Path:
    """A directory with a `kvgate` that runs this checkout's CLI."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kvgate").write_text(f'#!/bin/sh\nexec {shlex.quote(PYTHON)} -m gateway "$@"\n')
    (bin_dir / "kvgate").chmod(0o755)
    return bin_dir
