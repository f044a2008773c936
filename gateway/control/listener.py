"""The control plane's listener: the admin API's app served by uvicorn on an address of its own
(`control.host:control.port`), inside the gateway's event loop, apart from the data plane.

uvicorn runs as a task of the gateway's loop (`Server.serve`) with lifespan off, no websockets and
no signal handlers of its own: the gateway keeps SIGTERM, SIGINT and SIGHUP. The socket is bound
here, before the task starts, so a taken port fails the gateway's start before any engine is
launched, and a port 0 is known at once. h11 parses requests: it bounds request heads (16 KiB);
connections are capped (`control.max_connections`) and closed after `control.idle_timeout_s` of
silence, before their first request too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
# uvicorn's lines about its own start and stop repeat the gateway's; its errors still show.
logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would take SIGTERM and SIGINT from the gateway for as long as it serves (and
        # raise them again when it stops); the gateway stops it itself. vLLM embeds it the same way.
        yield


class _BoundedH11(H11Protocol):
    """uvicorn's h11 protocol, with its keep-alive timer armed from the connection's first moment:
    uvicorn starts it only after a response, so a connection that never sends a request would hold
    a slot (and a descriptor) for ever."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


class ControlListener:
    """Raises OSError when the address cannot be bound."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        grace_period_s: float,
        max_connections: int = 32,
        idle_timeout_s: float = 5.0,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=128)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            http=_BoundedH11,
            # An operator's port, but still a peer that may misbehave: bounded in connections
            # (503 beyond) and in how long a silent connection is kept.
            limit_concurrency=max_connections,
            # uvicorn declares an int but hands it to loop.call_later, which takes fractions too.
            timeout_keep_alive=idle_timeout_s,  # type: ignore[arg-type]
            ws="none",
            lifespan="off",
            log_config=None,  # the gateway's logging, as configured
            access_log=False,  # admin changes are logged (and audited) by the admin API itself
            proxy_headers=False,  # the audit names the peer's address, not what a header claims
            server_header=False,
            # Admin calls are short; one still running when the gateway stops gets the grace period.
            timeout_graceful_shutdown=math.ceil(grace_period_s),
        )
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="kvgate-control")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the control plane stopped: %r", task.exception())

    async def stop(self) -> None:
        """Stop accepting, close idle connections, let calls in progress finish (grace period)."""
        if self._task is None:
            self.sock.close()
            return
        self.server.should_exit = True
        await asyncio.wait({self._task})  # how it ended, if badly, is logged by _ended
