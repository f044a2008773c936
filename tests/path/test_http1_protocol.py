"""The http1 transport's response parsing, driven in-process through an in-memory transport:
answers split at every byte, chunked edges, bad framing, bodies ended by the close, bytes nobody
asked for, oversized heads, a connection lost at each stage, and read back-pressure. The
real-socket suites (test_transports, test_upstream_hostile*) hold the same rules end to end."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from gateway.path.transports import http1
from gateway.path.transports.base import DisconnectedError, ProtocolError
from tests.conftest import wait_until
from tests.mock_transport import MockTransport

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n\r\n{}"
MAX_HEAD = 4096
MAX_HEADERS = 16
BODY = b'{"id":"x","choices":[]}'  # 23 bytes


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    # A real, unconnected TCP socket: the connection sets TCP_NODELAY on it and asks the kernel
    # how many bytes wait on it (none), as it would of a live one.
    with socket.socket() as s:
        yield s


class Engine:
    """One upstream connection, the engine's side of it played by the test."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.conn = http1._Connection(("http", "e", 80), MAX_HEAD, MAX_HEADERS)
        self.transport = MockTransport(self.conn, sock)
        self.conn.connection_made(self.transport)

    def send(self) -> asyncio.Future[int]:
        head = self.conn.start(REQUEST)
        assert self.transport.take() == REQUEST
        return head

    async def body(self) -> bytes:
        parts = []
        while piece := await asyncio.wait_for(self.conn.readany(), 10.0):
            parts.append(piece)
        return b"".join(parts)


def ok(body: bytes = BODY, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%b\r\n%b" % (len(body), extra, body)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
ANSWERS = {
    "content_length": ok(),
    "chunked": CHUNKED_HEAD + b"5\r\n" + BODY[:5] + b"\r\n12\r\n" + BODY[5:] + b"\r\n0\r\n\r\n",
    "chunk_extensions_and_trailer": CHUNKED_HEAD
    + b"17;ext=1\r\n"
    + BODY
    + b"\r\n0;end\r\nX-Trailer: t\r\n\r\n",
    "upper_case_chunk_size": CHUNKED_HEAD + b"0000017\r\n" + BODY + b"\r\n0\r\n\r\n",
    "interim_answers_first": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    + ok(),
}


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("step", [1, 3, None])
async def test_an_answer_split_anywhere_is_read_whole_and_leaves_the_connection_reusable(
    answer: str, step: int | None, sock: socket.socket
) -> None:
    engine = Engine(sock)
    head = engine.send()
    engine.transport.feed(ANSWERS[answer], step)
    assert await head == 200
    assert await engine.body() == BODY
    assert not any(name.lower() == "link" for name, _ in engine.conn.headers)  # the 103's are gone
    assert engine.conn.reusable
    assert not engine.transport.aborted


@pytest.mark.parametrize(
    "answer",
    [
        ok(extra=b"Connection: close\r\n"),
        b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY),
    ],
    ids=["connection_close", "http10"],
)
async def test_an_answer_that_ends_the_connection_is_read_but_not_reused(answer: bytes) -> None:
    engine = Engine()
    head = engine.send()
    engine.transport.feed(answer)
    assert await head == 200
    assert await engine.body() == BODY
    assert not engine.conn.reusable


async def test_a_body_without_length_or_chunking_ends_with_the_connection() -> None:
    engine = Engine()
    head = engine.send()
    engine.transport.feed(b"HTTP/1.1 200 OK\r\n\r\n" + BODY[:10], 4)
    assert await head == 200
    assert await engine.conn.readany() == BODY[:10]
    engine.transport.feed(BODY[10:])
    engine.transport.peer_closed()
    assert await engine.body() == BODY[10:]
    assert engine.conn.complete and not engine.conn.reusable


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (CHUNKED_HEAD + b"zz\r\n" + BODY, ProtocolError),  # a chunk size that is not hex
        (CHUNKED_HEAD + b"17\r\n" + BODY + b"XX0\r\n\r\n", ProtocolError),  # no CRLF after the data
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcde", ProtocolError),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            ProtocolError,
        ),
        (b"HTTP/1.1 200 OK\r\nX: a\r\n folded\r\nContent-Length: 0\r\n\r\n", ProtocolError),
        (b"HTTP/1.1 2OO OK\r\n\r\n", ProtocolError),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", ProtocolError),
        (b"HTTP/1.1 600 Odd\r\nContent-Length: 0\r\n\r\n", ProtocolError),
    ],
    ids=[
        "bad_chunk_size",
        "chunk_overrun",
        "duplicate_length",
        "length_and_chunked",
        "obs_fold",
        "bad_status",
        "switching_protocols",
        "status_600",
    ],
)
async def test_bad_framing_fails_the_answer_and_the_connection(answer: bytes, error: type[Exception]) -> None:
    engine = Engine()
    head = engine.send()
    engine.transport.feed(answer, 2)
    with pytest.raises(error):
        await head
        await engine.body()  # a framing error in the body surfaces to the reader
    assert engine.transport.aborted
    assert not engine.conn.reusable


async def test_a_head_over_the_byte_limit_fails_interim_heads_included() -> None:
    engine = Engine()
    head = engine.send()
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </%b>\r\n\r\n" % (b"a" * (MAX_HEAD // 2))
    # Each head is within the limit alone. (The count is checked after each read that leaves the
    # final head incomplete: a read that completes it may overrun the limit by its own size.)
    engine.transport.feed(interim * 3 + ok(), 512)
    with pytest.raises(ProtocolError, match="exceeds"):
        await head
    assert engine.transport.aborted


async def test_more_headers_than_allowed_fail_the_answer() -> None:
    engine = Engine()
    head = engine.send()
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1))
    engine.transport.feed(ok(extra=many), 7)
    with pytest.raises(ProtocolError, match="headers"):
        await head


async def test_headers_just_within_the_limits_are_kept() -> None:
    engine = Engine()
    head = engine.send()
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS - 1))  # Content-Length makes the last
    engine.transport.feed(ok(extra=many), 7)
    assert await head == 200
    assert len(engine.conn.headers) == MAX_HEADERS


async def test_a_second_answer_in_the_same_read_poisons_the_connection(sock: socket.socket) -> None:
    engine = Engine(sock)
    head = engine.send()
    engine.transport.feed(ok() + ok(b"not yours"))  # pipelined: one client's answer to another
    assert await head == 200
    assert await engine.body() == BODY  # the answer asked for is whole
    assert engine.conn.poisoned and not engine.conn.reusable
    assert engine.transport.aborted


async def test_bytes_after_a_whole_answer_or_while_idle_poison_the_connection(sock: socket.socket) -> None:
    engine = Engine(sock)
    head = engine.send()
    engine.transport.feed(ok())
    assert await head == 200
    assert await engine.body() == BODY
    assert engine.conn.reusable
    engine.transport.feed(b"H")  # nobody asked
    assert engine.conn.poisoned and not engine.conn.reusable
    assert engine.transport.aborted


@pytest.mark.parametrize(
    ("reused", "got_bytes", "stale"), [(True, False, True), (True, True, False), (False, False, False)]
)
async def test_a_close_before_the_head_is_stale_only_on_a_reused_connection_that_said_nothing(
    reused: bool, got_bytes: bool, stale: bool
) -> None:
    engine = Engine()
    engine.conn.reused = reused
    head = engine.send()
    if got_bytes:
        engine.transport.feed(b"HTTP/1.1 20")
    engine.transport.peer_closed(ConnectionResetError())
    with pytest.raises(DisconnectedError, match="before answering") as caught:
        await head
    assert caught.value.stale is stale  # a stale idle connection: the request may go again


@pytest.mark.parametrize(
    "cut",
    [ok()[:-5], CHUNKED_HEAD + b"17\r\n" + BODY + b"\r\n", CHUNKED_HEAD + b"17\r\n" + BODY[:9]],
    ids=["short_length", "no_last_chunk", "mid_chunk"],
)
async def test_a_close_mid_body_fails_the_reader(cut: bytes) -> None:
    engine = Engine()
    head = engine.send()
    engine.transport.feed(cut)
    assert await head == 200
    engine.transport.peer_closed()
    with pytest.raises(DisconnectedError, match="mid-answer"):
        await engine.body()
    assert not engine.conn.reusable


async def test_reading_pauses_while_the_body_waits_for_a_slow_client() -> None:
    engine = Engine()
    head = engine.send()
    big = b"d" * (http1._HIGH_WATER + 1)
    engine.transport.feed(ok(big), 65536)
    assert await head == 200
    assert not engine.transport.reading  # the engine is held back, not buffered without bound
    assert engine.conn.read_nowait() == big
    assert engine.transport.reading
    assert engine.conn.read_nowait() == b""  # complete


async def test_a_reader_waiting_for_the_body_is_woken_by_each_piece() -> None:
    engine = Engine()
    head = engine.send()
    engine.transport.feed(CHUNKED_HEAD)
    assert await head == 200
    assert engine.conn.read_nowait() is None  # nothing yet, not the end
    reader = asyncio.create_task(engine.conn.readany())
    await wait_until(lambda: engine.conn._body.waiting, 10.0, "the reader waiting")
    engine.transport.feed(b"3\r\nabc\r\n")
    assert await asyncio.wait_for(reader, 10.0) == b"abc"
    engine.transport.feed(b"0\r\n\r\n")
    assert await engine.body() == b""
    assert engine.conn.reusable
