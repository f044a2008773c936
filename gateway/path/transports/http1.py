"""kvgate's own HTTP/1.1 client for the hot path: keep-alive pools and a C parser (llhttp).

The proxy only ever sends a POST with a JSON body to an engine and streams the answer back,
so it needs none of a general client's machinery (cookies, redirects, proxies, multipart).
Measured, aiohttp's client cost about as much CPU per proxied request as the rest of the
gateway together; this one writes the request in one `transport.write` and parses with
httptools. The rules that make it safe with an engine that misbehaves:

- A connection is reused only after one complete, well-framed final response with nothing
  after it: bytes that arrive while it is idle, after its answer was whole, or that wait
  unread in the kernel when its answer completes or when it is taken from the pool mean it is
  closed, never read as the next answer (which would hand one client's answer to another).
  Bytes that come later still, once the next request went out, cannot be told apart by any
  such check: so a connection is reused only to an engine that echoes `X-Request-Id`, and an
  answer on it that does not carry the id sent is refused (`AnswerProof`).
- 1xx answers are skipped; 101 is an error (nothing here asked to switch protocols).
- The head is bounded in bytes (`upstream.max_header_bytes`, 1xx heads included) and in
  header count (`upstream.max_headers`); llhttp rejects bad header bytes and ambiguous framing.
- A request that hits a stale idle connection (closed with not one byte back), or whose answer
  on a reused connection is not provably its own, is resent once, on a fresh connection, only
  when the caller allows it (`resend`); the resend counts as a delivery.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Mapping
from typing import TYPE_CHECKING

import httptools

from gateway.path.transports.base import (
    AnswerProof,
    ConnectError,
    DisconnectedError,
    HeaderLookup,
    ProtocolError,
    Slot,
    StrayAnswerError,
    Target,
    TransportError,
    client_tls_context,
    describe,
    find_header,
    header_block,
    pending_bytes,
    request_id,
)
from gateway.path.transports.inflow import Inflow

if TYPE_CHECKING:
    from gateway.config import UpstreamConfig

# Pause reading from the engine when this much of its answer waits for a slow client.
_HIGH_WATER = 256 * 1024


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_callback_error",
        "_final",
        "_head",
        "_head_bytes",
        "_header_count",
        "_informational",
        "_max_head_bytes",
        "_max_headers",
        "_parser",
        "complete",
        "error",
        "fd",
        "got_bytes",
        "headers",
        "keep_alive",
        "loop",
        "origin",
        "poisoned",
        "reused",
        "transport",
        "uses",
    )

    def __init__(self, origin: tuple[str, str, int], max_head_bytes: int, max_headers: int) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fd = -1
        self.error: BaseException | None = None
        self.complete = True  # no exchange in progress
        self.poisoned = False  # something arrived that nobody asked for: never reuse
        self.reused = False
        self.got_bytes = False
        self.keep_alive = False
        self.uses = 0  # exchanges started on it: an idle expiry meant for an earlier idle spell is void
        self.headers: list[tuple[str, str]] = []
        self._max_head_bytes = max_head_bytes
        self._max_headers = max_headers
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[int] | None = None
        self._final = False
        self._informational = False
        self._head_bytes = 0
        self._header_count = 0
        self._callback_error: TransportError | None = None
        self._body = Inflow(_HIGH_WATER, self._pause_reading, self._resume_reading)

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = transport  # type: ignore[assignment]
        # Looked up once: on Python 3.11 each get_running_loop() is a getpid() system call.
        self.loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
            # A streamed first token must not wait on Nagle + delayed ACK (~40 ms).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        parser = self._parser
        if parser is None or self.complete:
            self._poison()  # while idle, or after the answer was whole: an unsolicited answer
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.complete:  # the answer was whole; what followed it was not asked for
                self._poison()
            else:
                self._fail(
                    self._callback_error or ProtocolError(f"malformed response from the engine: {exc}")
                )
            return
        if not self._final:
            self._head_bytes += len(data)
            if self._head_bytes > self._max_head_bytes:
                self._fail(ProtocolError(f"engine response head exceeds {self._max_head_bytes} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.complete or self.error is not None:
            return  # failed already: this is the abort that followed, not the engine's doing
        why = describe(exc) if exc is not None else "connection closed"
        if not self._final:
            self._fail(
                DisconnectedError(
                    f"engine closed the connection before answering ({why})",
                    stale=self.reused and not self.got_bytes,
                )
            )
        elif self._delimited_by_close():
            self.complete = True  # HTTP/1.0 style: the body ends where the connection does
            self._body.wake()
        else:
            self._fail(DisconnectedError(f"engine closed the connection mid-answer ({why})"))

    def _delimited_by_close(self) -> bool:
        te = find_header(self.headers, "transfer-encoding")
        chunked = te is not None and te.rstrip().lower().endswith("chunked")
        return not chunked and find_header(self.headers, "content-length") is None

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Unsolicited  # a second answer to one request

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._max_headers:
            self._callback_error = ProtocolError(f"engine response has more than {self._max_headers} headers")
            raise self._callback_error
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._informational = True  # 100 Continue, 103 Early Hints: the answer follows
            self.headers = []
            self._header_count = 0
            return
        if not 200 <= status <= 599:
            self._callback_error = ProtocolError(f"engine answered with status {status}")
            raise self._callback_error
        self._final = True
        if self._head is not None and not self._head.done():
            self._head.set_result(status)

    def on_body(self, body: bytes) -> None:
        self._body.feed(body)

    def _pause_reading(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        # Asked here: llhttp forgets the message's keep-alive state once the callback returns.
        assert self._parser is not None
        self.keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._body.wake()

    # -- used by Http1Response -------------------------------------------------------------

    def _poison(self) -> None:
        self.poisoned = True
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        self._body.fail(exc)
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return (
            self.transport is not None
            and self.error is None
            and self.complete
            and self.keep_alive
            and not self.poisoned
            and not self._body
        )

    def start(self, request: bytes) -> asyncio.Future[int]:
        assert self.transport is not None and self.loop is not None
        self.uses += 1
        self.complete = False
        self.got_bytes = False
        self.keep_alive = False
        self.headers = []
        self._final = False
        self._informational = False
        self._head_bytes = 0
        self._header_count = 0
        self._callback_error = None
        self._body.clear()
        self._parser = httptools.HttpResponseParser(self)
        self._head = self.loop.create_future()
        self.transport.write(request)
        return self._head

    async def readany(self) -> bytes:
        while not self._body:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            assert self.loop is not None
            await self._body.wait(self.loop)
        return self._body.take()

    def read_nowait(self) -> bytes | None:
        if self._body:
            return self._body.take()
        if self.complete:
            return b""
        if self.error is not None:
            raise self.error
        return None

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


class _Unsolicited(Exception):
    """Raised from a parser callback to stop parsing at a second answer."""


class Http1Response(HeaderLookup):
    __slots__ = ("_conn", "_slot", "_transport", "headers", "sent", "status")

    def __init__(
        self, status: int, conn: _Connection, transport: Http1Transport, slot: Slot, sent: int
    ) -> None:
        self.status = status
        self.sent = sent
        self.headers: list[tuple[str, str]] = conn.headers
        self._conn: _Connection | None = conn
        self._transport = transport
        self._slot = slot

    async def readany(self) -> bytes:
        if self._conn is None:
            return b""
        return await self._conn.readany()

    def read_nowait(self) -> bytes | None:
        return b"" if self._conn is None else self._conn.read_nowait()

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._transport.put(conn)
        self._slot.release()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()
        self._slot.release()


class Http1Transport:
    """Idle keep-alive connections per origin, most recently used first."""

    def __init__(self, cfg: UpstreamConfig, max_idle_per_host: int = 512) -> None:
        self.connect_timeout_s = cfg.connect_timeout_s
        self.keepalive_s = cfg.keepalive_s
        self.max_idle_per_host = min(max_idle_per_host, cfg.max_connections)
        self._max_head_bytes = cfg.max_header_bytes
        self._max_headers = cfg.max_headers
        self._tls_cfg = cfg.tls
        self._tls: ssl.SSLContext | None = None
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self.proof = AnswerProof(cfg.reuse_unverified_connections)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = client_tls_context(self._tls_cfg.verify, self._tls_cfg.ca_file)
        return self._tls

    async def _connect(self, target: Target) -> _Connection:
        loop = asyncio.get_running_loop()
        origin = target.origin
        tls = self._tls_context() if target.tls else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(origin, self._max_head_bytes, self._max_headers),
                    target.host,
                    target.port,
                    ssl=tls,
                    server_hostname=target.host if tls is not None else None,
                )
        except TimeoutError:
            raise ConnectError(f"connect to {target.host_header} timed out") from None
        except ssl.SSLError as exc:
            raise ConnectError(f"TLS with {target.host_header} failed: {exc.reason or exc}") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {target.host_header}: {describe(exc)}") from None
        return conn

    def _expire(self, conn: _Connection, uses: int) -> None:
        idle = self._idle.get(conn.origin)
        if idle is not None and conn.uses == uses and conn in idle:  # still idle since it was put
            idle.remove(conn)
            if conn.transport is not None:
                conn.transport.close()
                conn.transport = None

    def _take_idle(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            # is_closing: the engine's FIN arrived, connection_lost has not run yet.
            if conn.reusable and not conn.transport.is_closing() and pending_bytes(conn.fd) == 0:  # type: ignore[union-attr]
                conn.reused = True
                return conn
            conn.abort()
        return None

    def put(self, conn: _Connection) -> None:
        conn._parser = None
        idle = self._idle.setdefault(conn.origin, [])
        if (
            conn.reusable
            and len(idle) < self.max_idle_per_host
            and self.proof.reusable(conn.origin)
            and pending_bytes(conn.fd) == 0  # more than the answer came: a second one, perhaps
        ):
            idle.append(conn)
            # Closed once idle for keepalive_s, whether or not this engine is asked again.
            asyncio.get_running_loop().call_later(self.keepalive_s, self._expire, conn, conn.uses)
        elif conn.complete and conn.error is None and conn.transport is not None:
            conn.transport.close()  # the answer was whole: a clean close, not a reset
            conn.transport = None
        else:
            conn.abort()

    async def request(
        self,
        method: str,
        target: Target,
        body: bytes,
        headers: Mapping[str, str],
        *,
        slot: Slot,
        resend: bool,
    ) -> Http1Response:
        head = f"{method} {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n{header_block(headers)}"
        rid = request_id(headers)
        keep = rid is not None and self.proof.reusable(target.origin)
        # Not to be reused: the engine is told, so that it closes first and keeps the TIME_WAIT.
        close = "" if keep else "Connection: close\r\n"
        request = f"{head}{close}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body
        sent = 0
        conn = self._take_idle(target.origin) if keep else None
        if conn is not None:
            sent = 1
            try:
                return self._answer(await conn.start(request), conn, rid, slot, sent)
            except DisconnectedError as exc:
                if not (resend and exc.stale):
                    exc.sent = sent
                    raise
                # The engine closed this idle connection as the request went out: not its
                # answer. Once, on a fresh connection (another idle one may be as stale).
            except StrayAnswerError:
                conn.abort()  # the engine drops this request with it
                if not resend:
                    raise
                # Once more on a fresh connection, where the first answer is always its own.
            except BaseException:
                conn.abort()  # cancelled or failed mid-request: the engine must see us go
                raise
        try:
            conn = await self._connect(target)
        except ConnectError as exc:
            exc.sent = sent
            raise
        try:
            return self._answer(await conn.start(request), conn, rid, slot, sent + 1)
        except TransportError as exc:
            exc.sent = sent + 1
            conn.abort()
            raise
        except BaseException:
            conn.abort()
            raise

    def _answer(
        self, status: int, conn: _Connection, rid: str | None, slot: Slot, sent: int
    ) -> Http1Response:
        try:
            self.proof.check(conn.origin, conn.reused, rid, find_header(conn.headers, "x-request-id"))
        except StrayAnswerError as exc:
            exc.sent = sent
            raise
        return Http1Response(status, conn, self, slot, sent)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
