"""Start simulator processes for tests (real processes on loopback), and read what they saw."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.conftest import PYTHON, free_port, subprocess_env


@contextmanager
def sim_process(
    *args: str, profile: str = "tiny", speedup: float = 20.0, env: dict[str, str] | None = None
) -> Iterator[str]:
    """One simulated replica; yields its URL once /health answers 200. `env` adds environment variables."""
    port = free_port()
    argv = [
        PYTHON,
        "-m",
        "gateway.sim",
        "--model",
        "m",
        "--port",
        str(port),
        "--profile",
        profile,
        "--speedup",
        str(speedup),
        *args,
    ]
    proc = subprocess.Popen(
        argv, env={**subprocess_env(), **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulator did not start: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            time.sleep(0.05)
        yield url
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
