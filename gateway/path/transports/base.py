"""The transport seam: how one request reaches an engine and how its answer comes back.

Two implementations, chosen by `upstream.transport`: `http1` (gateway/path/transports/http1.py,
kvgate's own keep-alive client on llhttp, the default and the fast one) and `aiohttp`
(gateway/path/transports/aiohttp_client.py, aiohttp's client, the fallback). Both take a request
and return a `Response` whose head has arrived, and fail only with the errors below, so the
layer above (gateway/path/upstream.py: timeouts, caps, delivery accounting) is written once.

What both share lives here: request header validation, the per-host
connection cap, TLS contexts, the check for bytes waiting on an idle connection, and the proof
that an answer on a reused connection is its request's (`AnswerProof`).
"""

from __future__ import annotations

import asyncio
import fcntl
import re
import ssl
import termios
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from gateway.config import Target


class TransportError(Exception):
    """A request that got no usable answer. `sent`: how many times its bytes were written to
    an engine before it failed (0, 1, or 2 with the one silent resend a stale connection may
    cost), which is what the proxy counts against `retry.max_attempts`."""

    sent = 0

    def __init__(self, message: str, *, sent: int = 0) -> None:
        super().__init__(message)
        self.sent = sent


class ConnectError(TransportError):
    """No connection could be made (refused, unreachable, timed out, TLS handshake failed)."""


class DisconnectedError(TransportError):
    """The engine closed or reset the connection before its answer was complete. `stale`: on a
    reused keep-alive connection, with not one byte back: the engine may have closed it as the
    request went out (the keep-alive race), which is what earns the one silent resend."""

    def __init__(self, message: str, *, sent: int = 0, stale: bool = False) -> None:
        super().__init__(message, sent=sent)
        self.stale = stale


class ProtocolError(TransportError):
    """The engine's answer was malformed or over a limit (status line, headers, framing)."""


class StrayAnswerError(ProtocolError):
    """An answer on a reused connection that is not provably this request's (`AnswerProof`):
    perhaps a late second answer to the connection's previous request."""


class InvalidHeaderError(ValueError):
    """A request header that must not be sent: control characters, not Latin-1, or a header
    that is the transport's own business (framing, connection management)."""


# -- request headers --------------------------------------------------------------------------
# Headers that frame the message or manage the connection are the transport's to write.
_OWN = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection", "te"}
    | {"trailer", "upgrade"}
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_LATIN1_TEXT = re.compile(r"[\t\x20-\x7e\x80-\xff]*")  # a value: no control characters but HTAB
_names_seen: set[str] = set()  # header names already found valid: names repeat, values do not


def _valid_name(name: str) -> bool:
    if _TOKEN.fullmatch(name) is None or name.lower() in _OWN:
        return False
    if len(_names_seen) < 4096:  # clients choose names: bounded
        _names_seen.add(name)
    return True


def header_block(headers: Mapping[str, str]) -> str:
    """`Name: value\r\n` lines, refusing any header that would change the request's framing
    (CR/LF or other control characters, a transport-owned name, characters not in Latin-1)."""
    for k, v in headers.items():
        # Printable ASCII is the common case and the cheap test; the regex only for the rest.
        if not (v.isascii() and v.isprintable()) and _LATIN1_TEXT.fullmatch(v) is None:
            raise InvalidHeaderError(f"request header {k[:64]!r} has a value that cannot be forwarded")
        if k not in _names_seen and not _valid_name(k):
            raise InvalidHeaderError(f"request header {k[:64]!r} cannot be forwarded to the engine")
    return "".join([f"{k}: {v}\r\n" for k, v in headers.items()])


_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")


def valid_response_header(name: bytes, value: bytes) -> bool:
    """What llhttp enforces, for parsers that are laxer: a token name, no control bytes."""
    return _NAME.fullmatch(name) is not None and _VALUE.fullmatch(value) is not None


# -- per-host connection cap ------------------------------------------------------------------
class Slot:
    """One request's share of a host's connections; released exactly once."""

    __slots__ = ("_origin", "_owner")

    def __init__(self, owner: HostSlots, origin: tuple[str, str, int]) -> None:
        self._owner: HostSlots | None = owner
        self._origin = origin

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._release(self._origin)


class HostSlots:
    """At most `limit` requests in flight per origin, hence at most `limit` connections: a
    transport opens a connection only when none is idle, and a request holds one at a time.
    Waiters are served first come, first served; how long they wait is the caller's bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used: dict[tuple[str, str, int], int] = {}
        self._waiters: dict[tuple[str, str, int], deque[asyncio.Future[None]]] = {}

    def in_use(self, origin: tuple[str, str, int]) -> int:
        return self._used.get(origin, 0)

    def try_acquire(self, origin: tuple[str, str, int]) -> Slot | None:
        # No need to look at the queue: a release hands its slot to a live waiter rather than
        # freeing it, so the count is below the limit only when nobody is waiting.
        used = self._used.get(origin, 0)
        if used < self.limit:
            self._used[origin] = used + 1
            return Slot(self, origin)
        return None

    async def acquire(self, origin: tuple[str, str, int]) -> Slot:
        if (slot := self.try_acquire(origin)) is not None:
            return slot
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(origin, deque()).append(waiter)
        try:
            await waiter  # a releasing request hands its slot over: the count stays as it is
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release(origin)  # handed a slot, then cancelled before using it
            elif (queue := self._waiters.get(origin)) is not None and waiter in queue:
                queue.remove(waiter)
            raise
        return Slot(self, origin)

    def _release(self, origin: tuple[str, str, int]) -> None:
        waiters = self._waiters.get(origin)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        if waiters is not None:
            del self._waiters[origin]
        self._used[origin] -= 1


# -- whose answer is this ---------------------------------------------------------------------
class AnswerProof:
    """Whether an answer on a reused connection can be proved to be this request's, per origin.

    An engine may answer twice, or send bytes past its framing, late enough that they arrive
    after the connection went back to work: no check of the socket can tell such a stray answer
    from the next request's own. An engine that echoes the request's `X-Request-Id` (vLLM with
    `--enable-request-id-headers`, which the launcher sets; the simulator likewise) can: its
    answers must carry the id that was sent, else they are refused. An origin is known to echo
    once an answer carried the id sent; the first answer on a fresh connection is always its
    request's own (nothing came before it), so one without the id there means the engine does
    not echo, and it is forgotten; so it is after a stray answer, until a fresh connection's
    answer carries its id again. Connections to an origin not known to echo are not reused
    (the request says `Connection: close`, so the engine keeps the TIME_WAIT) unless
    `upstream.reuse_unverified_connections` allows it.
    """

    __slots__ = ("_echoes", "_unverified")

    def __init__(self, reuse_unverified: bool) -> None:
        self._unverified = reuse_unverified
        self._echoes: set[tuple[str, str, int]] = set()

    def reusable(self, origin: tuple[str, str, int]) -> bool:
        return self._unverified or origin in self._echoes

    def check(self, origin: tuple[str, str, int], reused: bool, sent: str | None, got: str | None) -> None:
        """Raise StrayAnswerError when the answer cannot be proved to be the one to the request that
        sent `sent` (None: it sent no id)."""
        if sent is not None and got == sent:
            if len(self._echoes) < 65536:  # engine addresses are the operator's, but bounded all the same
                self._echoes.add(origin)
            return
        if not reused:
            if sent is not None:
                self._echoes.discard(origin)
            return
        if got is not None or not self._unverified:
            # Its other connections are as suspect: none is reused until a fresh one's answer
            # carries its id again (so the resend, too, goes out on a fresh connection).
            self._echoes.discard(origin)
            raise StrayAnswerError(
                "the engine's answer on a reused connection is not provably this request's"
                f" (X-Request-Id {'missing' if got is None else 'of another request'})"
            )


def request_id(headers: Mapping[str, str]) -> str | None:
    """The `X-Request-Id` the gateway sends (spelled so by gateway/path/sanitize.py)."""
    rid = headers.get("X-Request-Id")
    return rid if rid is not None else find_header(headers.items(), "x-request-id")


# -- connections ------------------------------------------------------------------------------
_ZERO = (0,)


def pending_bytes(fd: int) -> int:
    """Bytes the kernel holds for this socket that the event loop has not read yet. An idle
    keep-alive connection with any is never reused: they are not the answer to what we would
    send next. Unknown counts as pending."""
    count = array("i", _ZERO)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)  # filled in place: no bytes built and unpacked
    except OSError:
        return 1
    return count[0]


def client_tls_context(verify: bool, ca_file: str | None) -> ssl.SSLContext:
    """The standard library's client defaults (certificate and host name checked against the
    system's CAs, or `ca_file`); `verify: false` turns both checks off, on explicit request only."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


# -- the seam ---------------------------------------------------------------------------------
class Response(Protocol):
    """An engine's answer whose head arrived; read the body with `readany` until b"", then
    `release` (keep the connection if it is clean) or `close` (drop it: the engine aborts)."""

    status: int
    headers: list[tuple[str, str]]
    sent: int  # times the request was written to get this answer: 2 after a silent resend

    def header(self, name: str) -> str | None: ...

    @property
    def content_type(self) -> str: ...

    async def readany(self) -> bytes: ...

    def read_nowait(self) -> bytes | None:
        """What `readany` would return without waiting (b"": the body has ended); None when it
        would wait."""
        ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    async def request(
        self,
        method: str,
        target: Target,
        body: bytes,
        headers: Mapping[str, str],
        *,
        slot: Slot,
        resend: bool,
    ) -> Response:
        """Send once (twice at most, when `resend` and the first try hit a stale connection)
        and wait for the final head; 1xx answers are skipped. The response owns `slot` and
        releases it with itself; on failure the caller releases it."""
        ...

    async def close(self) -> None: ...


def find_header(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


class HeaderLookup:
    """What every transport's response offers on top of its `headers` list."""

    __slots__ = ()
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        return find_header(self.headers, name)

    @property
    def content_type(self) -> str:
        return (self.header("content-type") or "").split(";", 1)[0].strip().lower()


def describe(exc: BaseException | Any) -> str:
    """An OS error as a short phrase (`Connection refused`), anything else as its text."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
