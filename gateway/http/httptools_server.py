"""The data plane's lean HTTP/1.1 server (`server.impl: httptools`, the default): llhttp parses
(through httptools, as the upstream client does), the routes are the same handlers aiohttp's
server runs, and an answer goes out in one socket write where it can.

Its limits are aiohttp's: a request target of at most 8,190 bytes (414), a header name or value of
at most 8,190 bytes and at most 128 headers (431); llhttp in strict mode refuses ambiguous framing
(Content-Length with Transfer-Encoding, duplicate Content-Length, a Transfer-Encoding that does not
end in chunked, bad chunk sizes, bare LF, obsolete line folding) and an HTTP/1.1 request without
Host is refused here: each with 400 and the connection closed. Pipelined requests are answered in
order, one at a time. A client that leaves cancels its handler, and so the upstream call.
Connection caps and the header and keep-alive timeouts are the connection guard's
(gateway/http/conn_guard.py); the body's size and idle timeout are request_body's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config import ServerConfig
from gateway.errors import error_body
from gateway.http.conn_guard import GuardedConnection
from gateway.http.handling import failure_reply, route_error, unsupported_coding
from gateway.path.exchange import BodyError, Handler, Reply, Route, StreamOut
from gateway.path.transports.inflow import Inflow

log = logging.getLogger(__name__)

MAX_TARGET = 8190
MAX_FIELD = 8190
MAX_HEADERS = 128
MAX_PIPELINED = 16  # requests parsed ahead of the one being served before reading pauses
BODY_BUFFER = 1 << 20  # body bytes held for a handler that does not read them before reading pauses
# Answered before its body was read (413, say): the rest of the body is read and dropped for at most
# this long before closing, so the client, still sending, reads the answer instead of a reset.
LINGER_S = 5.0

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_EMPTY: Mapping[str, str] = {}


class _Refusal(Exception):
    """A request the server refuses before any handler sees it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Date:
    """The Date header's value, formatted once a second."""

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second, self.value = now, formatdate(now, usegmt=True).encode()
        return self.value


_DATE = _Date()


class Body:
    """A request's body as it arrives; `request_body.read_body` reads it."""

    __slots__ = ("_conn", "_error", "_inflow", "discard", "eof")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._inflow = Inflow(BODY_BUFFER, conn.pause_reading, conn.resume_reading)
        self._error: BodyError | None = None
        self.eof = False
        self.discard = False  # answered already: what still arrives is dropped

    def feed(self, data: bytes) -> None:
        if not self.discard:
            self._inflow.feed(data)

    def feed_eof(self) -> None:
        self.eof = True
        self._inflow.wake()

    def fail(self, message: str) -> None:
        if not self.eof:
            self._error = BodyError(message)
            self._inflow.wake()

    def read_nowait(self) -> bytes:
        if self._error is not None:
            raise self._error
        return self._inflow.take()

    def at_eof(self) -> bool:
        return self.eof and not self._inflow

    async def readany(self) -> bytes:
        while not self._inflow and not self.eof and self._error is None:
            await self._inflow.wait(self._conn.loop)
        return self.read_nowait()


class Request:
    """One parsed request (an `Exchange` for the route handlers)."""

    __slots__ = (
        "conn",
        "content",
        "content_length",
        "expects_continue",
        "head",
        "headers",
        "keep_alive",
        "method",
        "params",
        "path",
    )

    def __init__(
        self, conn: Connection, method: str, path: str, headers: CIMultiDictProxy[str], keep_alive: bool
    ) -> None:
        self.conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self.head = method == "HEAD"
        self.params: Mapping[str, str] = _EMPTY
        self.content = Body(conn)
        length = headers.get("content-length")  # llhttp has checked it is digits, and only one
        self.content_length = int(length) if length is not None else None
        self.expects_continue = headers.get("expect", "").lower() == "100-continue"

    async def stream(self, status: int, headers: dict[str, str]) -> StreamOut:
        return self.conn.open_stream(self, status, headers)

    async def send_continue(self) -> None:
        if self.expects_continue and not self.content.eof and not self.conn.lost:
            self.expects_continue = False
            self.conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")


class Stream:
    """An answer written piece by piece, chunked (or, with Connection: close, as it comes). The
    head goes out with the first piece: one write, one segment for the first token."""

    __slots__ = ("chunked", "conn", "done", "head")

    def __init__(self, conn: Connection, head: bytes, chunked: bool) -> None:
        self.conn = conn
        self.head = head
        self.chunked = chunked
        self.done = False

    async def write(self, data: bytes) -> None:
        conn = self.conn
        if conn.lost:
            raise ConnectionResetError("the client closed the connection")
        if not data:
            return  # an empty chunk would end the body
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self.head:
            data, self.head = self.head + data, b""
        conn.transport.write(data)
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)
        if self.conn.lost:
            raise ConnectionResetError("the client closed the connection")
        end = b"0\r\n\r\n" if self.chunked else b""
        if self.head or end:
            self.conn.transport.write(self.head + end)
            self.head = b""
        self.done = True


def _head(status: int, headers: Mapping[str, str], length: int | None, close: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:  # never split a header into two
            continue
        lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
    lines.append(b"Date: %b\r\n" % _DATE.get())
    if length is None:
        lines.append(b"Transfer-Encoding: chunked\r\n" if not close else b"")
    else:
        lines.append(b"Content-Length: %d\r\n" % length)
    if close:
        lines.append(b"Connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


class Connection(asyncio.Protocol):
    """One client connection: parses requests, serves them in order, writes the answers."""

    def __init__(self, server: HttptoolsServer) -> None:
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.guarded: GuardedConnection | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | Reply] = deque()  # a Reply: a refusal, answered in turn, then close
        self.parsing: Request | None = None  # the request whose body is arriving
        self.task: asyncio.Task[None] | None = None
        self.lost = False
        self.closing = False  # close after the answer in progress (shutdown)
        self.write_paused = False
        self.read_paused = False
        self._drain: asyncio.Future[None] | None = None
        self.lingering: asyncio.TimerHandle | None = None
        self._url: list[bytes] = []
        self._url_size = 0
        self._headers: list[tuple[str, str]] = []

    # -- asyncio protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Looked up once: on Python 3.11 each get_running_loop() is a getpid() system call.
        self.loop = asyncio.get_running_loop()
        protocol = self.transport.get_protocol()
        self.guarded = protocol if isinstance(protocol, GuardedConnection) else None
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            return  # refused: the rest is not read
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrades are not offered: the request is answered as it is, and the connection
            # closes after it (what follows is not HTTP/1.1).
            self.parser = None  # type: ignore[assignment]
            self.pause_reading()
            if self.parsing is not None:
                self.parsing.content.fail("protocol upgrades are not supported")
                self.parsing = None
            if self.queue and isinstance(self.queue[-1], Request):
                self.queue[-1].keep_alive = False
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refusal):
                self._refuse(cause.status, str(cause))
            else:
                self._refuse(400, f"malformed HTTP request: {exc}")

    def eof_received(self) -> bool | None:
        # A client that stops sending has left, as aiohttp's server takes it: the transport
        # closes, and what is in progress for it is cancelled.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.closed(self)
        if self.lingering is not None:
            self.lingering.cancel()
        if self.parsing is not None:
            self.parsing.content.fail("the client closed the connection")
        if self.task is not None:
            self.task.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        if self.write_paused:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    def pause_reading(self) -> None:
        if not self.read_paused and not self.lost:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not self.lost and self.parser is not None:
            self.read_paused = False
            self.transport.resume_reading()

    # -- parser callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url.clear()
        self._url_size = 0
        self._headers = []

    def on_url(self, url: bytes) -> None:
        self._url_size += len(url)
        if self._url_size > MAX_TARGET:
            raise _Refusal(414, f"request target longer than {MAX_TARGET} bytes")
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > MAX_FIELD or len(value) > MAX_FIELD:
            raise _Refusal(431, f"header longer than {MAX_FIELD} bytes")
        if len(self._headers) >= MAX_HEADERS:
            raise _Refusal(431, f"more than {MAX_HEADERS} headers")
        self._headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        parser = self.parser
        headers = CIMultiDictProxy(CIMultiDict(self._headers))
        version = parser.get_http_version()
        if version == "1.1" and "host" not in headers:
            raise _Refusal(400, "HTTP/1.1 request without a Host header")
        target = b"".join(self._url)
        path = target.partition(b"?")[0].decode("utf-8", "surrogateescape")
        if "%" in path:
            path = unquote(path, errors="surrogateescape")
        # HTTP/1.0 answers are not chunked: the connection's end ends them.
        keep_alive = parser.should_keep_alive() and version == "1.1"
        coding = headers.get("transfer-encoding")
        if coding is not None and unsupported_coding(coding):
            raise _Refusal(501, f"unsupported Transfer-Encoding {coding[:40]!r}; only chunked")
        request = Request(self, parser.get_method().decode("ascii"), path, headers, keep_alive)
        self.parsing = request
        self._enqueue(request)

    def on_body(self, body: bytes) -> None:
        assert self.parsing is not None
        self.parsing.content.feed(body)

    def on_message_complete(self) -> None:
        if self.parsing is not None:
            self.parsing.content.feed_eof()
            self.parsing = None
        if self.lingering is not None:
            self.transport.close()  # the unread body is over: nothing left to reset

    # -- serving -----------------------------------------------------------------------------
    def _enqueue(self, item: Request | Reply) -> None:
        if self.lingering is not None:
            return  # closing once the body before it is over: not served
        self.queue.append(item)
        if len(self.queue) > MAX_PIPELINED:
            self.pause_reading()
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    def _refuse(self, status: int, message: str) -> None:
        """A request the parser or a limit refuses: answered in turn, then the connection closes."""
        log.debug("refused a client request: %s", message)  # the client's doing: not above debug
        self.parser = None  # type: ignore[assignment]
        self.pause_reading()
        if self.parsing is not None:  # its handler is reading the body: it answers the 400
            self.parsing.content.fail(message)
            self.parsing = None
            return
        body = error_body(message, "invalid_request_error", "invalid_http_request")
        self._enqueue(Reply(status, body, {"Content-Type": "application/json"}))

    async def _serve(self) -> None:
        guard = self.guarded.guard if self.guarded is not None else None
        try:
            while self.queue and not self.lost:
                item = self.queue[0]
                if isinstance(item, Reply):
                    self.transport.write(_head(item.status, item.headers, len(item.body), True) + item.body)
                    self.transport.close()
                    return
                if guard is not None:
                    guard.request_started(self.guarded)  # type: ignore[arg-type]
                try:
                    keep = await self._answer(item)
                finally:
                    if guard is not None:
                        guard.request_finished(self.guarded)  # type: ignore[arg-type]
                self.queue.popleft()
                if not item.content.eof and self.parser is not None and not self.closing:
                    self._linger(item)
                    return
                if not keep or self.closing or (self.parser is None and not self.queue):
                    self.transport.close()
                    return
                if self.read_paused and len(self.queue) <= MAX_PIPELINED:
                    self.resume_reading()
        finally:
            self.task = None

    async def _answer(self, request: Request) -> bool:
        """Serve one request; whether the connection may carry another."""
        handler = self.server.resolve(request)
        if isinstance(handler, Reply):
            result: Reply | StreamOut = handler
        else:
            try:
                result = await handler(request)
            except Exception as exc:
                result = failure_reply(exc, request)
        # An unread body (a refusal before reading it) leaves the connection's framing unknown; a
        # request refused after this one (no parser any more) is answered next, then it closes.
        keep = request.keep_alive and request.content.eof and not self.closing
        if isinstance(result, Stream):
            return keep and result.done
        assert isinstance(result, Reply)
        body = result.body
        head = _head(result.status, result.headers, len(body), not keep)
        if request.head or not body:
            self.transport.write(head)
        elif len(body) < 65536:
            self.transport.write(head + body)  # one write: one syscall, one segment
        else:
            self.transport.writelines((head, body))
        return keep

    def _linger(self, request: Request) -> None:
        """Answered before the request's body was read: drop the rest of it, then close."""
        request.content.discard = True
        self.lingering = self.loop.call_later(LINGER_S, self.transport.close)
        self.resume_reading()

    def open_stream(self, request: Request, status: int, headers: dict[str, str]) -> StreamOut:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        close = not request.keep_alive
        return Stream(self, _head(status, headers, None, close), not close)

    def shut(self) -> None:
        """At shutdown: close now when idle, else after the answer in progress."""
        self.closing = True
        if self.task is None:
            self.transport.close()


class HttptoolsServer:
    """The routes, and the connections being served."""

    def __init__(self, routes: list[Route], server: ServerConfig) -> None:
        self.grace_period_s = server.grace_period_s
        self.exact: dict[str, dict[str, Handler]] = {}
        self.prefixed: list[tuple[str, str, str, Handler]] = []  # (prefix, method, parameter, handler)
        for route in routes:
            if route.tail is None:
                self.exact.setdefault(route.path, {})[route.method] = route.handler
            else:
                self.prefixed.append((route.path, route.method, route.tail, route.handler))
        self.connections: set[Connection] = set()
        self.all_closed: asyncio.Event | None = None  # set at shutdown, when the last one closes

    def closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        if not self.connections and self.all_closed is not None:
            self.all_closed.set()

    async def setup(self) -> None:
        return None

    def factory(self) -> asyncio.Protocol:
        return Connection(self)

    def resolve(self, request: Request) -> Handler | Reply:
        """The request's handler, its path parameter set; a 404 or 405 answer when there is none."""
        path = request.path
        method = "GET" if request.head else request.method
        methods = self.exact.get(path)
        if methods is None:
            for prefix, route_method, name, route_handler in self.prefixed:
                if path.startswith(prefix) and len(path) > len(prefix):
                    methods = methods or {}
                    methods.setdefault(route_method, route_handler)
                    request.params = {name: path[len(prefix) :]}
        if not methods:
            return route_error(404, "Not Found", request.method, path)
        handler = methods.get(method)
        if handler is None:
            reply = route_error(405, "Method Not Allowed", request.method, path)
            reply.headers["Allow"] = ", ".join(sorted(methods))
            return reply
        return handler

    async def shutdown(self) -> None:
        """Let requests in flight finish within the grace period, then close every connection."""
        self.all_closed = asyncio.Event()
        for conn in list(self.connections):
            conn.shut()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.all_closed.wait(), self.grace_period_s)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.transport.abort()
