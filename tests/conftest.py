"""Shared fixtures: real upstream servers and a real gateway, all on loopback sockets."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings, load_config
from gateway.server import RunningGateway, start_gateway
from tests.upstream_app import Upstream

REPO = Path(__file__).resolve().parent.parent


# How long a test waits for a process or server to start: CI's machine is a loaded 2-core one, where a
# Python process with several replicas takes seconds; a wait ends as soon as the start is seen.
STARTUP_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gateway_settings(endpoints: list[str], **overrides: Any) -> Settings:
    """A one-pool gateway config on ephemeral ports with fast health checks."""
    pool: dict[str, Any] = {
        "name": "p",
        "model": "m",
        "policy": {"type": "round_robin"},
        "endpoints": [{"url": u, "name": f"r{i}"} for i, u in enumerate(endpoints)],
    }
    pool.update(overrides.pop("pool", {}))
    data: dict[str, Any] = {
        "server": {"port": 0, "grace_period_s": 5},
        "control": {"port": 0},  # listens only with an admin key (`control={"admin_key": ...}`)
        # A check times out only well past a loaded machine's pauses: tests eject replicas by their
        # answers (503, a refused connection), never by a slow one.
        "health": {"interval_s": 0.1, "timeout_s": 5.0, "failure_threshold": 1, "success_threshold": 1},
        "retry": {"backoff_initial_s": 0.001, "backoff_max_s": 0.01},
        "pools": [pool],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return load_config(None, data)


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[[int], Awaitable[list[Upstream]]]]:
    started: list[Upstream] = []

    async def make(n: int) -> list[Upstream]:
        ups = [await Upstream(f"u{i}").start() for i in range(n)]
        started.extend(ups)
        return ups

    yield make
    for u in started:
        await u.stop()


SERVER_IMPLS = ("httptools", "aiohttp")  # the data plane's HTTP servers (server.impl)


def with_server_impl(settings: Settings, impl: str | None) -> Settings:
    """`settings` with the data plane on the `impl` HTTP server (None: as configured)."""
    if impl is None:
        return settings
    return settings.model_copy(update={"server": settings.server.model_copy(update={"impl": impl})})


@pytest.fixture
def server_impl() -> str | None:
    """The HTTP server the `gateway` fixture starts: None keeps the config's. Suites that must hold
    on both servers override it with one parametrized over SERVER_IMPLS."""
    return None


@pytest.fixture
async def gateway(server_impl: str | None) -> AsyncIterator[Callable[[Settings], Awaitable[RunningGateway]]]:
    started: list[RunningGateway] = []

    async def make(settings: Settings) -> RunningGateway:
        gw = await start_gateway(with_server_impl(settings, server_impl))
        started.append(gw)
        return gw

    yield make
    for gw in started:
        await gw.stop()


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


PYTHON = sys.executable


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition", interval: float = 0.01
) -> Any:
    """Poll `predicate` (a function, or a coroutine function) until it gives a true value, and
    return that value; after `timeout` seconds fail naming `what`. The one place async tests wait
    on state they cannot await. A predicate may act before it checks (publish a probe, say) and
    may raise to stop the wait early."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def wait_until_sync(
    predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition", interval: float = 0.01
) -> Any:
    """`wait_until` for synchronous tests and helpers (the thread sleeps between polls)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
