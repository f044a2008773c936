"""One client request and its answer as route handlers see them, whatever HTTP server carries them
(`server.impl`: the lean httptools server or aiohttp's, gateway/http/). A handler takes an
`Exchange` and returns a `Reply` (a whole answer) or the `StreamOut` it opened with
`Exchange.stream` (an answer written piece by piece)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple, Protocol

import orjson


class Reply:
    """A whole answer: status, headers (Content-Type among them) and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers if headers is not None else {}


def json_reply(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, orjson.dumps(data), {"Content-Type": "application/json", **(headers or {})})


class BodyError(Exception):
    """The request body cannot be read: bad chunked framing, or the client stopped mid-body."""


class BodySource(Protocol):
    """The request body as it arrives (aiohttp's StreamReader is one)."""

    def read_nowait(self) -> bytes: ...
    def at_eof(self) -> bool: ...
    async def readany(self) -> bytes: ...


class StreamOut(Protocol):
    """An answer being written: its status and headers are sent, chunks follow. A write to a client
    that has gone raises ConnectionResetError (aiohttp's StreamResponse is one)."""

    async def write(self, data: bytes) -> None: ...
    async def write_eof(self, data: bytes = b"") -> None: ...


class Exchange(Protocol):
    # Read-only members, so that each server's request may hold narrower types (aiohttp's
    # CIMultiDictProxy headers and StreamReader body) and still be an Exchange.
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def headers(self) -> Mapping[str, str]:
        """Names case-insensitive."""
        ...

    @property
    def content_length(self) -> int | None: ...
    @property
    def content(self) -> BodySource: ...

    @property
    def params(self) -> Mapping[str, str]:
        """The route's path parameter, by name."""
        ...

    async def stream(self, status: int, headers: dict[str, str]) -> StreamOut:
        """Send the status and headers now; the body follows through the returned writer."""
        ...

    async def send_continue(self) -> None:
        """`100 Continue`, once, to a client that sent `Expect: 100-continue`: only when its body
        is about to be read, so that a request refused before (auth, size, a cap) gets its final
        status instead of an invitation to send a body nobody reads."""
        ...


Handler = Callable[[Exchange], Awaitable["Reply | StreamOut"]]


class Route(NamedTuple):
    """`path` exactly, or with `tail` set, `path` followed by one or more characters (slashes
    too: model ids hold them) given to the handler as the parameter `tail`."""

    method: str
    path: str
    handler: Handler
    tail: str | None = None
