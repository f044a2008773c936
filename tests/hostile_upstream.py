"""A hostile engine for tests: a raw asyncio TCP server on loopback whose every byte the test
controls, and which counts what reached it.

Each request is read in full (that is one delivery, recorded with the request's marker: the
body's `prompt`, or its first message's content), then answered as `mode` says, or as the next
mode of `script` while it lasts (one per delivery). Modes, one per misbehaviour:

  ok                   a correct answer (JSON, or chunked SSE when the body asks to stream)
  hold                 like ok, but only once `release` is set (to pile requests up)
  hold-then-reset      an SSE head and one event, then, once `release` is set, a TCP RST (streams
                       that a killed engine was answering)
  close                close without a byte          reset      close with a TCP RST
  close-mid-head       part of a status line and headers, then close
  close-mid-body       Content-Length promises more than comes, then close
  close-mid-stream     two SSE events, then close (no terminating chunk)
  reset-mid-stream     two SSE events, then a TCP RST (a killed engine)
  malformed-mid-stream two SSE events, then one that is not JSON, then the rest
  error-mid-stream     two SSE events, then an engine error event and [DONE] (as vLLM ends a failed stream)
  end-mid-stream       two SSE events, then a clean end of the body without [DONE]
  long-then-close      `max_tokens` SSE events of 1 KiB of text each, then close (no terminating chunk)
  reset-after-usage    a whole answer (finish reason, usage chunk) but for [DONE], then a TCP RST
  reset-after-done     a whole answer through [DONE], then a TCP RST instead of the last chunk
  extra-response       the answer and, in the same write, a second answer nobody asked for
  extra-response-later the answer, then a second one as soon as the first is flushed
  stray-before-answer  on a reused connection, the previous request's answer again, then this one's
  informational        100 Continue and 103 Early Hints before the answer
  huge-head            a 256 KiB header value          many-headers  500 headers
  huge-body-declared   Content-Length of 1 GiB, data until the peer leaves
  huge-body-chunked    chunked JSON without end, until the peer leaves
  garbage-status       `HTTX/9 lol`                    bad-header-bytes  a control byte in a value
  bad-chunk            an invalid chunk size           cl-and-te  Content-Length and chunked
  switching            101 Switching Protocols         zero-status  `HTTP/1.1 000`
  stall-head           never answers                   stall-body  head and one event, then silence
  slow-drip            the answer in 16-byte pieces
  gzip                 the answer gzip-encoded         gzip-error  a gzip-encoded 400
  poison-500           a well-formed 500 when the prompt contains `boom` (a request that crashes generation)
  status-503           a well-formed 503             status-500  a well-formed 500
  error-first          an SSE head, then at once an engine error event and [DONE] (a decode leg
                       whose KV could not be loaded, vLLM's kv_load_failure_policy: fail)
  prefill-ok           a vLLM prefill leg's answer: one token and `kv_transfer_params` naming
                       127.0.0.1 as the side channel
  prefill-steer        the same naming `attacker.example` (a hostile prefill engine steering the
                       decode engine elsewhere); prefill-bad-port: 127.0.0.1, port "19998"
  stale-on-reuse       answers a connection's first request, closes on its second without a byte
  close-after-answer   answers (keep-alive, as far as the headers say), then closes at once
  http10               HTTP/1.0, the body delimited by closing the connection
  canary               a rotation of the above that never loses a request for good

Below the server: what the tests use to drive a gateway in front of it (settings, requests
with a unique marker each, OpenAI error checks, the check that every claim was settled).
"""

from __future__ import annotations

import asyncio
import gzip
import os
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from gateway.config import Settings
from gateway.server import RunningGateway
from tests.conftest import gateway_settings, wait_until


@dataclass
class Delivery:
    marker: str
    path: str
    headers: dict[str, str]  # names lowercased
    body: bytes
    connection: int
    index: int  # the request's position on its connection, from 0
    echo: tuple[str, ...] = ()  # the X-Request-Id header line its answers carry, if the engine echoes


def completion(marker: str) -> bytes:
    return orjson.dumps(
        {
            "id": f"cmpl-{marker}",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "text": marker, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def error_json(message: str, status: int) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": status}}
    )


def response(status: int, body: bytes, *extra: str, reason: str = "OK") -> bytes:
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join([*head, *extra]) + "\r\n\r\n").encode("latin-1") + body


def sse_event(marker: str, i: int, chat: bool = False) -> bytes:
    """The i-th event of an answer: a completion's text, or a chat chunk's delta (`chat`)."""
    if chat:
        delta: dict[str, str] = {"content": f"{marker}:{i} "}  # words: a continuation has a seam
        if i == 0:
            delta["role"] = "assistant"
        doc: dict[str, object] = {
            "id": f"chatcmpl-{marker}",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta}],
        }
    else:
        doc = {
            "id": f"cmpl-{marker}",
            "object": "text_completion",
            "choices": [{"index": 0, "text": f"{marker}:{i}"}],
        }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def is_chat(d: Delivery) -> bool:
    return d.path.endswith("/chat/completions")


def echoed(raw: bytes, d: Delivery) -> bytes:
    """`raw`, an answer's bytes from its status line on, with the request id after the status line."""
    status, sep, rest = raw.partition(b"\r\n")
    return b"".join([status, sep, *(line.encode("latin-1") + b"\r\n" for line in d.echo), rest])


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse_head(d: Delivery) -> bytes:
    lines = ["HTTP/1.1 200 OK", "Content-Type: text/event-stream", "Transfer-Encoding: chunked", *d.echo]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Mode = Callable[["HostileUpstream", Delivery, Reader, Writer], Awaitable[bool]]
MODES: dict[str, Mode] = {}


def mode(name: str) -> Callable[[Mode], Mode]:
    def register(fn: Mode) -> Mode:
        MODES[name] = fn
        return fn

    return register


async def _answer(d: Delivery, writer: asyncio.StreamWriter, stream: bool) -> None:
    if stream:
        events = b"".join(chunk(sse_event(d.marker, i, is_chat(d))) for i in range(3))
        writer.write(sse_head(d) + events + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    else:
        writer.write(response(200, completion(d.marker), *d.echo))


def _streams(d: Delivery) -> bool:
    try:
        return bool(orjson.loads(d.body).get("stream"))
    except (orjson.JSONDecodeError, AttributeError):
        return False


async def _until_peer_leaves(reader: asyncio.StreamReader) -> bool:
    while await reader.read(65536):
        pass
    return False


@mode("ok")
async def _ok(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    await _answer(d, w, _streams(d))
    return True


@mode("hold")
async def _hold(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    srv.held += 1
    try:
        await srv.release.wait()
    finally:
        srv.held -= 1
    await _answer(d, w, _streams(d))
    return True


@mode("hold-then-reset")
async def _hold_then_reset(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(sse_head(d) + chunk(sse_event(d.marker, 0, is_chat(d))))
    await w.drain()
    srv.held += 1
    try:
        await srv.release.wait()
    finally:
        srv.held -= 1
    return await _reset(srv, d, r, w)


@mode("close")
async def _close(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    return False


@mode("reset")
async def _reset(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    sock = w.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return False


@mode("close-mid-head")
async def _mid_head(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: appl")
    return False


@mode("close-mid-body")
async def _mid_body(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    body = completion(d.marker)
    w.write(response(200, body, *d.echo)[: -len(body) // 2])
    return False


@mode("close-mid-stream")
async def _mid_stream(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(
        sse_head(d) + chunk(sse_event(d.marker, 0, is_chat(d))) + chunk(sse_event(d.marker, 1, is_chat(d)))
    )
    return False


@mode("reset-mid-stream")
async def _reset_mid_stream(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    await _mid_stream(srv, d, r, w)
    await w.drain()
    return await _reset(srv, d, r, w)


@mode("long-then-close")
async def _long_then_close(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    count = int(orjson.loads(d.body).get("max_tokens") or 1)
    w.write(sse_head(d))
    for i in range(count):
        doc = {"id": f"cmpl-{d.marker}", "choices": [{"index": 0, "text": f" {i:04d}" + "x" * 1019}]}
        w.write(chunk(b"data: " + orjson.dumps(doc) + b"\n\n"))
        await w.drain()
    return False


_BROKEN_EVENTS = {
    "malformed-mid-stream": b'data: {"id": "cmpl-x", "choices": [{"te\n\n' + sse_event("later", 9),
    "error-mid-stream": b"data: " + error_json("engine dead: CUDA error", 500) + b"\n\ndata: [DONE]\n\n",
    "end-mid-stream": b"",
}


def _broken_stream(name: str) -> Mode:
    async def send(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
        events = (
            sse_event(d.marker, 0, is_chat(d)) + sse_event(d.marker, 1, is_chat(d)) + _BROKEN_EVENTS[name]
        )
        w.write(sse_head(d) + chunk(events) + b"0\r\n\r\n")
        return True

    return send


for _name in _BROKEN_EVENTS:
    MODES[_name] = _broken_stream(_name)


def _whole_stream(marker: str) -> bytes:
    last = {
        "id": f"cmpl-{marker}",
        "choices": [{"index": 0, "text": f"{marker}:2", "finish_reason": "length"}],
    }
    usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    tail = {"id": f"cmpl-{marker}", "choices": [], "usage": usage}
    events = sse_event(marker, 0) + sse_event(marker, 1) + b"data: " + orjson.dumps(last) + b"\n\n"
    return events + b"data: " + orjson.dumps(tail) + b"\n\n"


@mode("reset-after-usage")
async def _reset_after_usage(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(sse_head(d) + chunk(_whole_stream(d.marker)))
    await w.drain()
    return await _reset(srv, d, r, w)


@mode("reset-after-done")
async def _reset_after_done(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(sse_head(d) + chunk(_whole_stream(d.marker) + b"data: [DONE]\n\n"))
    await w.drain()
    return await _reset(srv, d, r, w)


def _intruder(srv: HostileUpstream, d: Delivery) -> bytes:
    # Another client's answer if there is one (with its request id, as a second answer to that
    # request would have): an answer that would reach the wrong client.
    others = [x for x in srv.deliveries[-8:] if x.marker != d.marker]
    if not others:
        return response(200, completion("intruder"))
    return response(200, completion(others[-1].marker), *others[-1].echo)


@mode("extra-response")
async def _extra(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(response(200, completion(d.marker), *d.echo) + _intruder(srv, d))
    return True


@mode("extra-response-later")
async def _extra_later(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(response(200, completion(d.marker), *d.echo))
    await w.drain()
    w.write(_intruder(srv, d))
    return True


@mode("stray-before-answer")
async def _stray_before(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    # On a reused connection, the previous request's answer once more before this one's: a stray
    # answer that arrived just after this request went out, where no check of the socket sees it.
    previous = [x for x in srv.deliveries if x.connection == d.connection and x.index == d.index - 1]
    if previous:
        w.write(response(200, completion(previous[0].marker), *previous[0].echo))
    await _answer(d, w, _streams(d))
    return True


@mode("informational")
async def _informational(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
    )
    await w.drain()
    await _answer(d, w, _streams(d))
    return True


@mode("huge-head")
async def _huge_head(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(echoed(b"HTTP/1.1 200 OK\r\nX-Big: ", d))
    for _ in range(64):
        w.write(b"a" * 4096)
        await w.drain()
    w.write(b"\r\nContent-Length: 2\r\n\r\nhi")
    return False


@mode("many-headers")
async def _many(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(response(200, completion(d.marker), *(f"X-H{i}: v" for i in range(500))))
    return True


@mode("huge-body-declared")
async def _huge_declared(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(
        echoed(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n", d)
    )
    return await _flood(w, lambda data: data)


@mode("huge-body-chunked")
async def _huge_chunked(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(
        echoed(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n", d)
    )
    return await _flood(w, chunk)


async def _flood(w: asyncio.StreamWriter, frame: Callable[[bytes], bytes]) -> bool:
    block = frame(b"x" * 65536)
    try:
        for _ in range(16384):  # 1 GiB, unless the peer leaves first
            w.write(block)
            await w.drain()
    except ConnectionError:
        pass
    return False


def _fixed(raw: bytes, keep: bool = False) -> Mode:
    async def send(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
        w.write(echoed(raw, d))
        return keep

    return send


MODES["garbage-status"] = _fixed(b"HTTX/9 lol\r\n\r\n")
MODES["bad-header-bytes"] = _fixed(b"HTTP/1.1 200 OK\r\nX-Bad: a\x01b\r\nContent-Length: 2\r\n\r\nhi")
MODES["bad-chunk"] = _fixed(
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nhello\r\n0\r\n\r\n"
)
MODES["cl-and-te"] = _fixed(
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
)
MODES["switching"] = _fixed(
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
)
MODES["zero-status"] = _fixed(b"HTTP/1.1 000 Zero\r\nContent-Length: 0\r\n\r\n")


@mode("stall-head")
async def _stall_head(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    return await _until_peer_leaves(r)


@mode("stall-body")
async def _stall_body(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    if _streams(d):
        w.write(sse_head(d) + chunk(sse_event(d.marker, 0, is_chat(d))))
    else:
        w.write(response(200, completion(d.marker), *d.echo)[:-5])
    return await _until_peer_leaves(r)


@mode("slow-drip")
async def _drip(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    raw = response(200, completion(d.marker), *d.echo)
    for i in range(0, len(raw), 16):
        w.write(raw[i : i + 16])
        await w.drain()
        await asyncio.sleep(0.001)
    return True


@mode("gzip")
async def _gzip(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(response(200, gzip.compress(completion(d.marker)), "Content-Encoding: gzip", *d.echo))
    return True


@mode("gzip-error")
async def _gzip_error(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    body = gzip.compress(error_json(f"bad request {d.marker}", 400))
    w.write(response(400, body, "Content-Encoding: gzip", *d.echo, reason="Bad Request"))
    return True


@mode("poison-500")
async def _poison(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    if "boom" in d.marker:
        w.write(response(500, error_json("generation crashed", 500), *d.echo, reason="Internal Server Error"))
        return True
    return await _ok(srv, d, r, w)


@mode("status-503")
async def _503(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(response(503, error_json("overloaded", 503), *d.echo, reason="Service Unavailable"))
    return True


@mode("status-500")
async def _500(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(response(500, error_json("engine failed", 500), *d.echo, reason="Internal Server Error"))
    return True


@mode("error-first")
async def _error_first(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    events = b"data: " + error_json("failed to load KV", 500) + b"\n\ndata: [DONE]\n\n"
    w.write(sse_head(d) + chunk(events) + b"0\r\n\r\n")
    return True


PREFILL_KV = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "engine-p0",
    "remote_block_ids": [1, 2],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}


@mode("prefill-ok")
async def _prefill_ok(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    doc = {**orjson.loads(completion(d.marker)), "kv_transfer_params": PREFILL_KV}
    w.write(response(200, orjson.dumps(doc), *d.echo))
    return True


def _prefill_naming(**kv: object) -> Mode:
    async def answer(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
        doc = {**orjson.loads(completion(d.marker)), "kv_transfer_params": {**PREFILL_KV, **kv}}
        w.write(response(200, orjson.dumps(doc), *d.echo))
        return True

    return answer


MODES["prefill-steer"] = _prefill_naming(remote_host="attacker.example", remote_port=19998)
MODES["prefill-bad-port"] = _prefill_naming(remote_port="19998")


@mode("stale-on-reuse")
async def _stale(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    if d.index > 0:
        return False
    return await _ok(srv, d, r, w)


@mode("close-after-answer")
async def _close_after(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    await _ok(srv, d, r, w)
    return False


@mode("http10")
async def _http10(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    w.write(echoed(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n", d) + completion(d.marker))
    return False


_CANARY = ("ok", "extra-response", "extra-response-later", "informational", "stale-on-reuse")


@mode("canary")
async def _canary(srv: HostileUpstream, d: Delivery, r: Reader, w: Writer) -> bool:
    return await MODES[_CANARY[len(srv.deliveries) % len(_CANARY)]](srv, d, r, w)


@dataclass
class HostileUpstream:
    mode: str = "ok"
    script: list[str] = field(default_factory=list)  # modes for the next deliveries, then `mode`
    name: str = ""  # how `journal` names this server
    journal: list[tuple[str, Delivery]] | None = None  # deliveries of several servers, in order
    echo: bool = True  # answers carry the request's X-Request-Id, as vLLM's with --enable-request-id-headers
    healthy: bool = True  # False: GETs (health checks) are answered 503
    tls: ssl.SSLContext | None = None
    port: int = 0  # 0: an ephemeral port; set it to come back on the same one after `stop`
    deliveries: list[Delivery] = field(default_factory=list)
    gets: list[str] = field(default_factory=list)  # paths of GETs (health checks, load scrapes)
    connections: int = 0
    held: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None
    _handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def markers(self) -> list[str]:
        return [d.marker for d in self.deliveries]

    def connections_used(self) -> int:
        """Connections that carried at least one generation request."""
        return len({d.connection for d in self.deliveries})

    async def start(self) -> HostileUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Close the port and every connection (the port refuses until `start` again)."""
        if self._server is not None:
            self._server.close()
            held = self.release.is_set()
            self.release.set()  # held answers go out into closed connections
            for writer in self._handlers.values():
                writer.transport.abort()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            if not held:
                self.release.clear()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = writer
        index = 0
        try:
            while (request := await _read_request(reader)) is not None:
                method, path, headers, body = request
                rid = headers.get("x-request-id")
                echo = (f"X-Request-Id: {rid}",) if self.echo and rid else ()
                if method == "GET":  # health checks, metrics scrapes: always fine, never a delivery
                    self.gets.append(path)
                    writer.write(response(200 if self.healthy else 503, b"{}", *echo))
                    continue
                d = Delivery(_marker(body), path, headers, body, conn, index, echo)
                index += 1
                self.deliveries.append(d)
                if self.journal is not None:
                    self.journal.append((self.name, d))
                how = self.script.pop(0) if self.script else self.mode
                keep = await MODES[how](self, d, reader, writer)
                await writer.drain()
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError):
            return
        finally:
            del self._handlers[task]
            writer.close()


def _marker(body: bytes) -> str:
    try:
        doc = orjson.loads(body)
        messages = doc.get("messages")
        if isinstance(messages, list) and messages:
            return str(messages[0].get("content", ""))
        return str(doc.get("prompt", ""))
    except (orjson.JSONDecodeError, AttributeError):
        return ""


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path, headers, body


# -- driving a gateway in front of it -----------------------------------------------------------
TRANSPORTS = ["http1", "aiohttp"]
MAX_ATTEMPTS = 3


def hostile_settings(urls: list[str], transport: str, **overrides: Any) -> Settings:
    upstream = {
        "transport": transport,
        "first_byte_timeout_s": 0.5,
        "idle_timeout_s": 0.5,
        "max_response_bytes": 1 << 20,
        **overrides.pop("upstream", {}),
    }
    return gateway_settings(
        urls,
        health={"enabled": False},
        breaker={"failure_threshold": 10, "open_s": 60, **overrides.pop("breaker", {})},
        retry={
            "max_attempts": MAX_ATTEMPTS,
            "backoff_initial_s": 0.001,
            "backoff_max_s": 0.002,
            **overrides.pop("retry", {}),
        },
        upstream=upstream,
        **overrides,
    )


def marker() -> str:
    return "m-" + os.urandom(6).hex()


async def ask(
    client: httpx.AsyncClient, gw: RunningGateway, mark: str, stream: bool = False
) -> httpx.Response:
    body = {"model": "m", "prompt": mark, "max_tokens": 4, "stream": stream}
    return await client.post(gw.url + "/v1/completions", json=body)


def openai_error(r: httpx.Response) -> dict[str, Any]:
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def sse_events(r: httpx.Response) -> list[str]:
    return [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]


def answer_marker(r: httpx.Response, stream: bool) -> str:
    if stream:
        first = orjson.loads(sse_events(r)[0])
        return first["choices"][0]["text"].split(":")[0]
    return r.json()["choices"][0]["text"]


async def assert_settled(gw: RunningGateway) -> None:
    """Load counters, probe flags and connection slots back at zero."""
    rt = gw.runtime
    replicas = [r for pool in rt.pools.values() for r in pool.replicas.values()]

    def settled() -> bool:
        return all(
            r.inflight_requests == 0 and r.inflight_tokens == 0 and not r.breaker.probe_in_flight
            for r in replicas
        ) and not any(rt.upstream.slots._used.values())

    await wait_until(settled, what="load, probes and connection slots released")
