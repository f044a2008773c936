"""Start simulator processes for tests (real processes on loopback), and read what they saw."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.conftest import PYTHON, subprocess_env


@contextmanager
def sim_process(
    *args: str, profile: str = "tiny", speedup: float = 20.0, env: dict[str, str] | None = None
) -> Iterator[str]:
    """One simulated replica; yields its URL once /health answers 200. `env` adds environment variables."""
    with sim_replicas(1, *args, profile=profile, speedup=speedup, env=env) as urls:
        yield urls[0]


@contextmanager
def sim_replicas(
    n: int, *args: str, profile: str = "tiny", speedup: float = 20.0, env: dict[str, str] | None = None
) -> Iterator[list[str]]:
    """`n` simulated replicas in one process, each with its own engine; yields their URLs once they listen."""
    argv = [
        PYTHON,
        "-m",
        "gateway.sim",
        "--model",
        "m",
        "--port",
        "0",
        "--replicas",
        str(n),
        "--profile",
        profile,
        "--speedup",
        str(speedup),
        *args,
    ]
    proc = subprocess.Popen(
        argv, env={**subprocess_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        urls: list[str] = []
        # Each replica prints its address once it listens (a port 0 bind picks free ports itself).
        while len(urls) < n:
            line = proc.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"simulator did not start: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            if line.startswith("kvgate-sim listening on "):
                urls.append(line.split()[3])
        # Keep reading what it prints, so a full pipe never blocks it.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield urls
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def seen(url: str, last: int = 16) -> list[dict[str, Any]]:
    """The request bodies a simulated replica received, oldest first."""
    async with httpx.AsyncClient() as c:
        return (await c.get(url + "/sim/requests", params={"last": last})).json()
