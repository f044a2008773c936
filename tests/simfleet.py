"""Simulated engines for tests: real `python -m gateway.sim` processes on loopback ports they pick
themselves, and what a replica saw. The one way tests start simulator processes (in-process
replicas for the simulator's own tests are tests/sim/conftest.py's `replica`)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import PYTHON, STARTUP_S, subprocess_env

_LISTENING = re.compile(r"kvgate-sim listening on (\S+)")


def launched_sims(tmp_path: Path, replicas: int, **extra: Any) -> dict[str, Any]:
    """A pool's `engines:` that has the gateway launch `replicas` quick simulated engines, logs
    under `tmp_path`, a killed one restarted at once."""
    return {
        "kind": "sim",
        "replicas": replicas,
        "startup_timeout_s": STARTUP_S,
        "restart_backoff_s": 0.1,
        "log_dir": str(tmp_path / "logs"),
        "sim": {"profile": "tiny", "speedup": 20},
        **extra,
    }


@dataclass
class SimFleet:
    proc: subprocess.Popen[bytes]
    urls: list[str]  # one per replica, in replica order
    log: Path  # the process's stderr

    @property
    def url(self) -> str:
        return self.urls[0]


@contextmanager
def sim_fleet(
    *args: str,
    replicas: int = 1,
    model: str = "m",
    profile: str = "tiny",
    speedup: float = 20.0,
    env: dict[str, str] | None = None,
    timeout: float = STARTUP_S,
) -> Iterator[SimFleet]:
    """`replicas` simulated replicas in one process, yielded once each listens; `args` are the
    simulator's own flags (`vllm serve` ones), `env` adds environment variables. The replicas echo
    X-Request-Id, as the launcher has them do, so that the gateway keeps connections to them."""
    argv = [PYTHON, "-m", "gateway.sim", "--model", model, "--port", "0", "--replicas", str(replicas)]
    argv.append("--enable-request-id-headers")
    argv += ["--profile", profile, "--speedup", str(speedup), *args]
    with sim_command(argv, replicas, env, timeout) as fleet:
        yield fleet


@contextmanager
def sim_command(
    argv: list[str], replicas: int, env: dict[str, str] | None = None, timeout: float = STARTUP_S
) -> Iterator[SimFleet]:
    """A command line that starts the simulator (with `--port 0`: it picks its ports), as a
    process of its own; yielded once its `replicas` replicas listen, stopped at the end."""
    with tempfile.TemporaryDirectory(prefix="kvgate-sim-") as tmp:
        log = Path(tmp) / "stderr.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                argv, env={**subprocess_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=err
            )
        try:
            yield SimFleet(proc, _listening(proc, replicas, log, timeout), log)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()


def _listening(proc: subprocess.Popen[bytes], replicas: int, log: Path, timeout: float) -> list[str]:
    """The replicas' URLs, as the simulator prints them once each serves. The pipe is read with
    os.read, not readline: a buffered reader can take several lines in one read and keep the rest
    where select() cannot see them, so a fleet whose replicas print together would seem silent."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    pending = b""
    urls: list[str] = []
    while len(urls) < replicas:
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"simulator did not start: {log.read_text(errors='replace')[-2000:]}")
        *lines, pending = (pending + chunk).split(b"\n")
        urls += [m.group(1) for line in lines if (m := _LISTENING.search(line.decode(errors="replace")))]
    return urls


@contextmanager
def sim_process(
    *args: str,
    profile: str = "tiny",
    speedup: float = 20.0,
    env: dict[str, str] | None = None,
    timeout: float = 20.0,
) -> Iterator[str]:
    """One simulated replica; yields its URL once it listens."""
    with sim_fleet(*args, profile=profile, speedup=speedup, env=env, timeout=timeout) as fleet:
        yield fleet.url


async def seen(url: str, last: int = 16) -> list[dict[str, Any]]:
    """The request bodies a simulated replica received, oldest first."""
    async with httpx.AsyncClient() as c:
        return (await c.get(url + "/sim/requests", params={"last": last})).json()


async def metric_values(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """A simulated replica's `/metrics` samples by name, labels dropped (buckets left out)."""
    text = (await c.get(f"{url}/metrics")).text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "_bucket" not in line
    }
