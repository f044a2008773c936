"""A lean HTTP/1.1 client for the hot path: keep-alive connection pools and a C parser.

The proxy only ever sends a POST with a JSON body to an engine and streams the answer
back, so it needs none of a general client's machinery (cookies, redirects, proxies,
tracing hooks, multipart). Measured here, aiohttp's client cost about as much CPU per
proxied request as the rest of the gateway together; this one writes the request in one
`transport.write` and parses the response with httptools (llhttp), which is what makes
the overhead budget reachable. Control-plane calls (health, metrics) keep using httpx or
aiohttp.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Mapping
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

# Pause reading from the engine when this much of its answer waits for a slow client.
_HIGH_WATER = 256 * 1024


class ConnectError(OSError):
    """The connection could not be made, or was closed before any answer: nothing was processed
    that a retry on another connection or replica could duplicate in a visible way."""


class ProtocolError(Exception):
    """The engine's answer was cut short or could not be parsed."""


@lru_cache(maxsize=4096)
def _split(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"the hot-path client speaks plain http only, not {parts.scheme!r}: {url}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname or "127.0.0.1", parts.port or 80, path


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_body_size",
        "_head",
        "_parser",
        "_paused",
        "_reader",
        "complete",
        "error",
        "got_bytes",
        "headers",
        "keep_alive",
        "key",
        "transport",
    )

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.complete = True
        self.got_bytes = False
        self.keep_alive = False
        self.headers: list[tuple[str, str]] = []
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[int] | None = None
        self._body: deque[bytes] = deque()
        self._body_size = 0
        self._reader: asyncio.Future[None] | None = None
        self._paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # A streamed first token must not wait on Nagle + delayed ACK (~40 ms).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._parser is None:  # bytes while idle: the engine broke the protocol
            self._fail(ProtocolError("unexpected bytes from the engine between requests"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"malformed response from the engine: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.complete:
            if not self.got_bytes:
                self._fail(ConnectError(f"engine closed the connection: {exc or 'EOF'}"))
            else:
                self._fail(ProtocolError(f"engine response cut short: {exc or 'connection closed'}"))
        else:
            self.error = self.error or ConnectionResetError("closed")

    # -- httptools callbacks ---------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self._head is not None and not self._head.done():
            assert self._parser is not None
            self._head.set_result(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_size += len(body)
        if self._body_size > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        # Asked here: llhttp forgets the message's keep-alive state once the callback returns.
        assert self._parser is not None
        self.keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._wake()

    # -- used by UpstreamResponse ------------------------------------------------------------
    def _wake(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        if self._reader is not None and not self._reader.done():
            self._reader.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return (
            self.transport is not None
            and self.error is None
            and self.complete
            and self.keep_alive
            and not self._body
        )

    def start(self, request: bytes) -> asyncio.Future[int]:
        assert self.transport is not None
        self.complete = False
        self.got_bytes = False
        self.keep_alive = False
        self.headers = []
        self._body.clear()
        self._body_size = 0
        self._parser = httptools.HttpResponseParser(self)
        self._head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._head

    async def readany(self) -> bytes:
        while not self._body:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        data = b"".join(self._body) if len(self._body) > 1 else self._body[0]
        self._body.clear()
        self._body_size = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


class UpstreamResponse:
    """A response whose headers arrived; the body is read with `readany` until b""."""

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, status: int, conn: _Connection, pool: ConnectionPool) -> None:
        self.status = status
        self.headers: list[tuple[str, str]] = conn.headers
        self._conn: _Connection | None = conn
        self._pool = pool

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def content_type(self) -> str:
        return (self.header("content-type") or "").split(";", 1)[0].strip().lower()

    async def readany(self) -> bytes:
        if self._conn is None:
            return b""
        return await self._conn.readany()

    def release(self) -> None:
        """Done with the response: the connection returns to the pool if it can be reused."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.put(conn)

    def close(self) -> None:
        """Abandon the response: the connection is dropped, which tells the engine to abort."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class ConnectionPool:
    """Idle keep-alive connections per (host, port), most recently used first."""

    def __init__(self, connect_timeout_s: float, max_idle_per_host: int = 512) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(key), key[0], key[1])
        except TimeoutError:
            raise ConnectError(f"connect to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from None
        return conn

    def put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if conn.reusable and len(idle) < self.max_idle_per_host:
            idle.append(conn)
        else:
            conn.abort()

    async def request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        host, port, path = _split(url)
        key = (host, port)
        lines = [f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
        payload = body or b""
        lines.append(f"Content-Length: {len(payload)}\r\n\r\n")
        request = "".join(lines).encode("latin-1") + payload
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.transport is None or conn.error is not None:
                continue
            try:
                return UpstreamResponse(await conn.start(request), conn, self)
            except ConnectError:
                # The engine had closed this idle connection: that is not its answer. Try a new one.
                continue
            except BaseException:
                conn.abort()  # cancelled or timed out mid-request: the engine must see us go
                raise
        conn = await self._connect(key)
        try:
            return UpstreamResponse(await conn.start(request), conn, self)
        except BaseException:
            conn.abort()
            raise

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
