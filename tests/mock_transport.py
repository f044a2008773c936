"""An in-memory asyncio transport, for protocol tests that drive the HTTP server's and client's
parsers byte by byte without a socket (as uvicorn's and httpcore's suites do beside their
real-socket ones): what the protocol writes is kept, reading can be paused, closing and a lost
peer reach the protocol as they would from the event loop."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httptools

from tests.rawhttp import RawResponse


class MockTransport(asyncio.Transport):
    def __init__(self, protocol: asyncio.Protocol, sock: socket.socket | None = None) -> None:
        super().__init__()
        self.protocol = protocol
        self.sock = sock
        self.written = bytearray()
        self.reading = True
        self.closed = False
        self.aborted = False

    # -- what a protocol calls ---------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closed:  # asyncio's transports drop writes after close
            self.written += data

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            # As asyncio does: connection_lost comes from the loop, after the caller returns.
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"socket": self.sock, "peername": ("127.0.0.1", 40000)}.get(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    # -- what a test calls -------------------------------------------------------------------
    def feed(self, data: bytes, step: int | None = None) -> None:
        """Hand `data` to the protocol as received bytes, in pieces of `step` bytes if given."""
        step = step or len(data) or 1
        for i in range(0, len(data), step):
            self.protocol.data_received(data[i : i + step])

    def peer_closed(self, exc: Exception | None = None) -> None:
        """The peer went away: the protocol hears it at once, as from a failed read."""
        if not self.closed:
            self.closed = True
            self.protocol.connection_lost(exc)

    def take(self) -> bytes:
        data = bytes(self.written)
        self.written.clear()
        return data


class _ResponseCollector:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.responses: list[RawResponse] = []
        self.complete = 0
        self._body: list[bytes] = []

    def on_message_begin(self) -> None:
        self.responses.append(RawResponse(0))
        self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.responses[-1].headers
        headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.responses[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.responses[-1].body = b"".join(self._body)
        self.complete += 1


def parse_responses(data: bytes, *, closed: bool = False) -> list[RawResponse]:
    """The complete HTTP/1.1 responses in `data`, in order, 1xx ones included (not answers to HEAD:
    llhttp would wait for the body their Content-Length announces). `closed`: the connection ended
    after `data`, which ends a body that has neither a length nor chunking."""
    collector = _ResponseCollector()
    collector.parser.feed_data(data)
    if closed and collector.complete < len(collector.responses):
        collector.on_message_complete()
    return collector.responses[: collector.complete]
