"""The control plane's listener: the admin API's app served by uvicorn on an address of its own
(`control.host:control.port`), inside the gateway's event loop, apart from the data plane.

uvicorn runs as a task of the gateway's loop (`Server.serve`) with lifespan off, no websockets and
no signal handlers of its own: the gateway keeps SIGTERM, SIGINT and SIGHUP. The socket is bound
here, before the task starts, so a taken port fails the gateway's start before any engine is
launched, and a port 0 is known at once. h11 parses requests.

An operator's port, but still reached by peers that may misbehave; what bounds them
(`_BoundedH11`): a request head of at most 16 KiB (431 beyond, however it arrives: h11 only
bounds a head still incomplete); a head must be whole within `control.header_timeout_s` of the
connection's start, or of its first byte for a keep-alive connection's next request (uvicorn's
idle timer restarts on every byte, so a head sent a byte at a time was never cut off); a connection
silent for `control.idle_timeout_s` is closed, before its first request too; a request body must
be whole within `control.body_deadline_s` of its head (408, and the connection closed: uvicorn has
no timer while a request is in progress, so a body trickled by a key holder held its slot for as
long as it went on, and that address's slots, once all held, locked every other call out); at most
`control.max_connections` connections (uvicorn answers 503 beyond) and
`control.max_connections_per_address` from one address. A newcomer at either cap first closes the
connection (of that address, at its cap) that has waited longest for a head: a slowloris flood
displaces its own members, not the operator's next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import error_body

log = logging.getLogger(__name__)
# uvicorn's lines about its own start and stop repeat the gateway's; its errors still show.
logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would take SIGTERM and SIGINT from the gateway for as long as it serves (and
        # raise them again when it stops); the gateway stops it itself. vLLM embeds it the same way.
        yield


MAX_HEAD_BYTES = 16 * 1024
_HEAD_TOO_LARGE = error_body(
    f"request head exceeds {MAX_HEAD_BYTES} bytes", "invalid_request_error", "request_header_too_large"
)
HEAD_TOO_LARGE_RESPONSE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_HEAD_TOO_LARGE)
) + _HEAD_TOO_LARGE


def _body_timeout_response(deadline_s: float) -> bytes:
    body = error_body(
        f"request body not received within control.body_deadline_s ({deadline_s:g} s)",
        "invalid_request_error",
        "request_timeout",
    )
    head = b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    return head % len(body) + b"Connection: close\r\n\r\n" + body


class _Slots:
    """One listener's connections that wait for a request head (oldest first), and its
    connections per peer address."""

    def __init__(
        self, max_connections: int, per_address: int, header_timeout_s: float, body_deadline_s: float
    ) -> None:
        self.max_connections = max_connections
        self.per_address = per_address
        self.header_timeout_s = header_timeout_s
        self.body_deadline_s = body_deadline_s
        self.body_timeout_response = _body_timeout_response(body_deadline_s)
        self.waiting: dict[_BoundedH11, None] = {}  # insertion order: longest waiting first
        self.by_address: dict[str, int] = {}

    def oldest_waiting(self, address: str | None = None) -> _BoundedH11 | None:
        return next((c for c in self.waiting if address is None or c.address == address), None)


class _BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with the bounds of the module docstring. uvicorn starts its
    keep-alive timer only after a response, so it is armed here from the connection's first moment
    too: a connection that never sends a request would otherwise hold a slot for ever."""

    slots: _Slots  # set on the listener's own subclass
    address: str | None = None
    _head: bytearray | None = None  # the next head's bytes so far, while waiting for one
    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None  # while a request's body is still coming

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        slots = self.slots
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        if slots.by_address.get(address, 0) >= slots.per_address:
            victim = slots.oldest_waiting(address)
            if victim is None:  # every connection of the address is busy: this one cannot be served
                transport.abort()
                return
            victim.evict()
        elif len(self.connections) >= slots.max_connections - 1:
            # uvicorn answers 503 when a request finds `limit_concurrency` connections, itself included.
            victim = slots.oldest_waiting()
            if victim is not None:
                victim.evict()
        super().connection_made(transport)
        self.address = address
        slots.by_address[address] = slots.by_address.get(address, 0) + 1
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._wait_for_head()
        self._head_timer = self.loop.call_later(slots.header_timeout_s, self._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.address is None:  # refused in connection_made: uvicorn never knew it
            return
        slots = self.slots
        left = slots.by_address[self.address] - 1
        if left:
            slots.by_address[self.address] = left
        else:
            del slots.by_address[self.address]
        self.address = None
        self._head_done()
        self._body_done()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            if self._head_timer is None:  # a keep-alive connection's next head: its clock starts now
                self._head_timer = self.loop.call_later(self.slots.header_timeout_s, self._head_timeout)
            head += data
            end = head.find(b"\r\n\r\n")
            if (end < 0 and len(head) > MAX_HEAD_BYTES) or end + 4 > MAX_HEAD_BYTES:
                self._head_done()
                self.transport.write(HEAD_TOO_LARGE_RESPONSE)
                self.transport.close()
                return
            if end >= 0:
                self._head_done()
        super().data_received(data)
        # h11 has consumed what it could: the request's body is still coming, or it is whole.
        if self.conn.their_state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.slots.body_deadline_s, self._body_timeout)
        else:
            self._body_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.address is not None and not self.transport.is_closing():
            self._wait_for_head()  # its clock starts at its first byte; silence is the idle timer's

    def _wait_for_head(self) -> None:
        self._head = bytearray()
        self.slots.waiting[self] = None

    def _head_done(self) -> None:
        self._head = None
        self.slots.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _body_done(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timeout(self) -> None:
        self._body_timer = None
        # The app is still reading the body, so nothing of an answer has gone out; the app then
        # hears a disconnect, and what it sends after is dropped.
        if not self.cycle.response_started:
            self.transport.write(self.slots.body_timeout_response)
        self.evict()

    def _head_timeout(self) -> None:
        self._head_timer = None
        self.evict()

    def evict(self) -> None:
        self._head_done()
        self.connections.discard(self)  # at once: the newcomer is counted against the cap next
        self.transport.close()


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
        header_timeout_s: float = 5.0,
        max_connections_per_address: int = 8,
        body_deadline_s: float = 10.0,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=128)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        self.slots = slots = _Slots(
            max_connections, max_connections_per_address, header_timeout_s, body_deadline_s
        )
        protocol = type("ControlH11", (_BoundedH11,), {"slots": slots})
        config = uvicorn.Config(
            app,
            http=protocol,
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
