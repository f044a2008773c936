"""Process lifecycle: start the runtime and listener, stop gracefully on SIGTERM/SIGINT.

On a stop signal /ready fails at once; after `server.shutdown_delay_s` (0: at once) the listener
closes (new connections are refused), requests in flight get up to `server.grace_period_s` to
finish, then managed engines are stopped and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from aiohttp import web

from gateway.admin import ReloadRejected, reload_config
from gateway.app import build_app
from gateway.config import Settings
from gateway.conn_guard import ConnectionGuard, connection_limit
from gateway.runtime import Runtime

log = logging.getLogger(__name__)


class RunningGateway:
    """A started gateway: its runtime and listener. `port` is the bound port (useful with port 0)."""

    def __init__(
        self, runtime: Runtime, runner: web.AppRunner, listener: asyncio.Server, guard: ConnectionGuard
    ) -> None:
        self.runtime = runtime
        self.runner = runner
        self.listener = listener
        self.guard = guard
        self.port: int = listener.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.runtime.settings.server.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening, let in-flight requests finish within the grace period, release all.

        Requests still queued shortly before the grace period ends are answered 503 with
        Retry-After (they could not finish in time anyway) instead of being dropped with it."""
        self.runtime.draining = True
        # /ready now fails; a load balancer (a Kubernetes Service) takes a moment to notice, and
        # until it does it still sends new connections here: serve them before closing.
        delay = self.runtime.settings.server.shutdown_delay_s
        if delay:
            log.info("draining: /ready fails, serving %.1f s more before closing the listener", delay)
            await asyncio.sleep(delay)
        grace = self.runtime.settings.server.grace_period_s
        shed = asyncio.get_running_loop().call_later(
            grace - min(1.0, grace / 10), self.runtime.scheduler.shed_queued, "the gateway is shutting down"
        )
        try:
            self.listener.close()
            self.guard.close_all()
            await self.runner.cleanup()
        finally:
            shed.cancel()
            await self.runtime.stop()


class ListenError(Exception):
    """The gateway's address cannot be bound (in use, not local, no permission)."""


async def start_gateway(
    settings: Settings, config_path: str | None = None, server_overrides: dict[str, Any] | None = None
) -> RunningGateway:
    """`config_path` and `server_overrides` (command-line server.* values) are what a reload re-reads."""
    runtime = Runtime(settings)
    runtime.config_path = config_path
    runtime.server_overrides = dict(server_overrides or {})
    server = settings.server
    runner = web.AppRunner(
        build_app(runtime),
        handler_cancellation=True,  # a client that leaves cancels its handler and so the upstream call
        access_log=None,
        shutdown_timeout=server.grace_period_s,
        # The connection guard closes idle connections (and counts them); aiohttp's own timer is a
        # backstop that must not beat it.
        keepalive_timeout=server.keepalive_timeout_s + 5.0,
        auto_decompress=False,  # request bodies are decoded, within bounds, by request_body
    )
    # Listen first: a taken port must fail before any engine is launched.
    await runner.setup()
    guard = ConnectionGuard(settings, connection_limit(settings), runner.server)
    runtime.connections = guard
    try:
        listener = await asyncio.get_running_loop().create_server(
            guard.protocol, server.host, server.port, backlog=4096, reuse_address=True
        )
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {server.host}:{server.port}: {exc.strerror or exc}") from None
    try:
        await runtime.start()
    except BaseException:
        listener.close()
        await runner.cleanup()
        await runtime.stop()
        raise
    gateway = RunningGateway(runtime, runner, listener, guard)
    log.info("kvgate listening on http://%s:%d", server.host, gateway.port)
    return gateway


async def _reload(runtime: Runtime) -> None:
    try:
        await reload_config(runtime, "SIGHUP")
    except ReloadRejected as exc:
        log.warning("SIGHUP: config reload rejected: %s", exc)


async def serve(
    settings: Settings, config_path: str | None = None, server_overrides: dict[str, Any] | None = None
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gateway = await start_gateway(settings, config_path, server_overrides)
    reloads: set[asyncio.Task[None]] = set()  # held so a running reload is not garbage-collected

    def on_sighup() -> None:
        task = asyncio.create_task(_reload(gateway.runtime))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    try:
        await stop.wait()
        log.info("stop signal: draining (grace %.0f s)", settings.server.grace_period_s)
    finally:
        await gateway.stop()
    log.info("kvgate stopped")
    return 0


def run(
    settings: Settings, config_path: str | None = None, server_overrides: dict[str, Any] | None = None
) -> int:
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(serve(settings, config_path, server_overrides))
    except ListenError as exc:
        log.error("%s", exc)
        return 1
