"""Client connections: bounded in number and in how long they may hold a slot without a request.

Every client connection passes through a `GuardedConnection`, a thin asyncio protocol in front of
the HTTP server's own (any server: it only relays the asyncio protocol calls). The HTTP layer tells
the guard when a request starts and ends (`request_started` / `request_finished`), which is all it
needs to know about HTTP.

* A new connection must have sent a complete request head (its handler started) within
  `server.header_timeout_s`, and so must a keep-alive connection from the first byte of its next
  request; a connection between requests is closed after `server.keepalive_timeout_s` of
  idleness. A request's body is bounded separately (`server.body_timeout_s` and
  `server.body_deadline_s`, in `request_body`).
* At most `server.max_connections` client connections are open. A connection that arrives when
  all are taken first makes room by closing the connection that has been waiting longest without
  a request in progress (one that never sent a request first): a flood of idle or half-open
  connections costs its own oldest members, not the clients being served.
* When every connection is serving a request, a newcomer is an overflow connection, one of at most
  `server.reserved_connections`: it is answered only if it asks for a health or readiness probe
  (`/health`, `/ready`, `/live`, and paths below them), anything else gets 503
  `too_many_connections` with Retry-After, and it is closed `header_timeout_s` after it came. Past
  the reserve, a connection is closed as soon as it is accepted. So probes keep their answers
  under a connection flood, and the process keeps file descriptors in hand.
* The first time the cap is reached a warning is logged, then at most one every
  `WARN_INTERVAL_S` with what was done since; counters are exported as metrics.

`connection_limit` raises the process's soft file-descriptor limit to its hard limit and lowers
`max_connections` (with a warning) when the descriptors cannot cover it plus the reserve, the
upstream connection pool and a margin for everything else the process opens.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum

from gateway.config import Settings
from gateway.errors import error_body

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 10.0
FD_MARGIN = 256  # descriptors kept for everything but client and upstream connections
PROBE_PATHS = (b"/health", b"/ready", b"/live")


def is_probe(method: bytes, path: bytes) -> bool:
    """A health probe: GET or HEAD of a probe path or one below it (`/ready/{model}`)."""
    return method in (b"GET", b"HEAD") and any(path == p or path.startswith(p + b"/") for p in PROBE_PATHS)


MAX_REQUEST_LINE = 2048  # an overflow connection's request line, read to see if it is a probe
_OVERLOADED = error_body(
    "the gateway has too many client connections; retry shortly",
    "service_unavailable",
    "too_many_connections",
)
OVERLOADED_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" % len(_OVERLOADED)
) + _OVERLOADED

CLOSE_REASONS = ("header_timeout", "idle_timeout", "evicted", "refused", "dropped")


class State(Enum):
    NEW = "new"  # accepted, no request yet
    BUSY = "busy"  # a request in progress
    IDLE = "idle"  # between requests
    OVERFLOW = "overflow"  # beyond the cap: a probe or a 503
    CLOSED = "closed"  # closed or being closed; no longer counted


class GuardedConnection(asyncio.Protocol):
    """One client connection: relays to the HTTP server's protocol, reports to the guard."""

    __slots__ = ("_line", "busy", "guard", "inner", "state", "transport")

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.state = State.NEW
        self.busy = 0
        self._line = b""  # an overflow connection's request line, until it is complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.guard.accept(self)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            if self.state is State.IDLE:
                self.guard.head_begun(self)
            self.inner.data_received(data)
        elif self.state is State.OVERFLOW:
            self._probe(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.lost(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def start(self) -> None:
        """Hand the connection to the HTTP server."""
        assert self.transport is not None
        self.inner = self.guard.factory()
        self.inner.connection_made(self.transport)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _probe(self, data: bytes) -> None:
        """An overflow connection: serve it if its request line asks for a probe, else 503."""
        self._line += data
        end = self._line.find(b"\n")
        if end < 0:
            if len(self._line) > MAX_REQUEST_LINE:
                self._refuse()
            return
        method, _, rest = self._line[:end].strip().partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if is_probe(method, path):
            line, self._line = self._line, b""
            self.start()
            assert self.inner is not None
            self.inner.data_received(line)
        else:
            self._refuse()

    def _refuse(self) -> None:
        assert self.transport is not None
        self._line = b""
        self.guard.note("refused")
        self.transport.write(OVERLOADED_RESPONSE)
        self.transport.close()


class ConnectionGuard:
    def __init__(
        self, settings: Settings, max_connections: int, factory: Callable[[], asyncio.Protocol]
    ) -> None:
        server = settings.server
        self.factory = factory
        self.max_connections = max_connections
        self.reserved = server.reserved_connections
        self.header_timeout_s = server.header_timeout_s
        self.keepalive_timeout_s = server.keepalive_timeout_s
        self.open = 0  # connections within the cap
        self.overflow = 0
        # Connections without a request in progress, by deadline (each kind has one timeout, so
        # insertion order is deadline order): never-used, between requests, overflow.
        self._new: OrderedDict[GuardedConnection, float] = OrderedDict()
        self._idle: OrderedDict[GuardedConnection, float] = OrderedDict()
        self._overflow: OrderedDict[GuardedConnection, float] = OrderedDict()
        self._tick = max(0.05, min(0.5, self.header_timeout_s / 4, self.keepalive_timeout_s / 4))
        self._sweeper: asyncio.TimerHandle | None = None
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)  # totals, for metrics
        self._since_warning = dict.fromkeys(CLOSE_REASONS, 0)
        self._warned_at = float("-inf")

    def protocol(self) -> GuardedConnection:
        """The protocol factory for the listening socket."""
        return GuardedConnection(self)

    # -- what connections report ---------------------------------------------------------------
    def accept(self, conn: GuardedConnection) -> None:
        now = time.monotonic()
        if self.open >= self.max_connections and not self._make_room():
            if self.overflow >= self.reserved:
                conn.state = State.CLOSED
                self.note("dropped")
                assert conn.transport is not None
                conn.transport.abort()
                return
            conn.state = State.OVERFLOW
            self.overflow += 1
            self._overflow[conn] = now + self.header_timeout_s
            self._arm()
            return
        self.open += 1
        self._new[conn] = now + self.header_timeout_s
        self._arm()
        conn.start()

    def request_started(self, conn: GuardedConnection) -> None:
        if conn.state is State.NEW:
            del self._new[conn]
        elif conn.state is State.IDLE:
            del self._idle[conn]
        elif conn.state is not State.BUSY:
            return  # an overflow probe, or a connection already being closed
        conn.state = State.BUSY
        conn.busy += 1

    def head_begun(self, conn: GuardedConnection) -> None:
        """A next request's first bytes on a connection between requests: its head, like a first
        one's, must be whole within the head timeout (a trickled head would keep the idle one)."""
        del self._idle[conn]
        conn.state = State.NEW
        self._new[conn] = time.monotonic() + self.header_timeout_s
        self._arm()

    def request_finished(self, conn: GuardedConnection) -> None:
        if conn.state is not State.BUSY:
            return
        conn.busy -= 1
        if conn.busy == 0:
            conn.state = State.IDLE
            self._idle[conn] = time.monotonic() + self.keepalive_timeout_s
            self._arm()

    def lost(self, conn: GuardedConnection) -> None:
        state, conn.state = conn.state, State.CLOSED
        if state is State.OVERFLOW:
            self.overflow -= 1
            self._overflow.pop(conn, None)
        elif state is not State.CLOSED:
            self.open -= 1
            self._new.pop(conn, None)
            self._idle.pop(conn, None)

    # -- making room, timeouts, warnings ---------------------------------------------------------
    def _make_room(self) -> bool:
        """Close the connection that has waited longest without a request in progress."""
        # Each kind's oldest is its first; its wait began one timeout before its deadline.
        heads = [
            (deadline - timeout, waiting)
            for waiting, timeout in (
                (self._new, self.header_timeout_s),
                (self._idle, self.keepalive_timeout_s),
            )
            if waiting
            for deadline in (next(iter(waiting.values())),)
        ]
        if not heads:
            return False
        waiting = min(heads, key=lambda head: head[0])[1]
        conn, _ = waiting.popitem(last=False)
        self._retire(conn, "evicted")
        return True

    def _retire(self, conn: GuardedConnection, reason: str) -> None:
        if conn.state is State.OVERFLOW:
            self.overflow -= 1
        else:
            self.open -= 1
        conn.state = State.CLOSED
        self.note(reason)
        conn.close()

    def _arm(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self._tick, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = time.monotonic()
        for waiting, reason in (
            (self._new, "header_timeout"),
            (self._idle, "idle_timeout"),
            (self._overflow, "header_timeout"),
        ):
            while waiting:
                conn, deadline = next(iter(waiting.items()))
                if deadline > now:
                    break
                del waiting[conn]
                self._retire(conn, reason)
        if self._new or self._idle or self._overflow:
            self._arm()

    def note(self, reason: str) -> None:
        """Count a connection closed by the guard; warn when the cap was the cause."""
        self.closed[reason] += 1
        self._since_warning[reason] += 1
        if reason in ("header_timeout", "idle_timeout"):
            return
        now = time.monotonic()
        if now - self._warned_at < WARN_INTERVAL_S:
            return
        first = self._warned_at == float("-inf")
        self._warned_at = now
        counts = self._since_warning
        log.warning(
            "client connections at the cap (server.max_connections %d, %d open)%s: %d waiting "
            "connections closed to make room, %d answered 503 (only probes are served), %d closed "
            "on accept (reserve of %d full)",
            self.max_connections,
            self.open,
            "" if first else f" in the last {WARN_INTERVAL_S:g} s",
            counts["evicted"],
            counts["refused"],
            counts["dropped"],
            self.reserved,
        )
        self._since_warning = dict.fromkeys(CLOSE_REASONS, 0)

    def close_all(self) -> None:
        """At shutdown: close connections the HTTP server does not know (overflow ones)."""
        for conn in list(self._overflow):
            self._retire(conn, "dropped")
        self._overflow.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def connection_limit(settings: Settings) -> int:
    """`server.max_connections`, lowered to what the file-descriptor limit can hold."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    wanted = settings.server.max_connections
    budget = soft - settings.server.reserved_connections - settings.upstream.max_connections - FD_MARGIN
    if wanted <= budget:
        return wanted
    limit = max(16, budget)
    log.warning(
        "server.max_connections %d lowered to %d: the process may open %d files, and needs %d for "
        "upstream connections (upstream.max_connections), %d reserved, %d for everything else",
        wanted,
        limit,
        soft,
        settings.upstream.max_connections,
        settings.server.reserved_connections,
        FD_MARGIN,
    )
    return limit
