"""A client's request body, read within bounds: size, time between reads and in all, content coding. Every
violation is the client's: a 4xx in the OpenAI error form. (Parsing it, within a JSON nesting
bound, is the request object's: gateway.path.request.)

Content codings: `gzip` (and `x-gzip`) and `deflate` bodies are decompressed as they arrive, and
`server.max_body_bytes` bounds the decompressed size, so a small compressed body cannot expand into
a large one (a zip bomb stops at the limit); `identity` is the default; any other coding is 415.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from aiohttp import web

from gateway.config import ServerConfig
from gateway.errors import GatewayError, client_error
from gateway.path.exchange import BodyError, BodySource, Exchange

# gzip or zlib-wrapped deflate, told apart by the stream's own header.
_ZLIB_AUTO = 32 + zlib.MAX_WBITS
_DECODED = frozenset({"gzip", "x-gzip", "deflate"})


def _too_large(limit: int) -> GatewayError:
    return client_error(f"request body exceeds {limit} bytes", "request_too_large", status=413)


def _decoder(request: Exchange) -> Any:
    """A zlib decompressor for the body's content coding, None for identity; 415 for others."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding in ("", "identity"):
        return None
    if coding in _DECODED:
        return zlib.decompressobj(_ZLIB_AUTO)
    raise client_error(
        f"unsupported Content-Encoding {coding[:40]!r}; use gzip, deflate or none",
        "unsupported_content_encoding",
        status=415,
    )


async def read_body(request: Exchange, server: ServerConfig) -> bytes:
    """The body, decoded, at most `server.max_body_bytes`; the client may pause at most
    `body_timeout_s` between two pieces of it and take `body_deadline_s` in all (a byte every few
    seconds makes no pause long, and would hold a connection forever)."""
    limit, idle_timeout_s, deadline_s = server.max_body_bytes, server.body_timeout_s, server.body_deadline_s
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit)
    decoder = _decoder(request)
    await request.send_continue()
    content = request.content
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    try:
        while True:
            # What has arrived already (all of a small body, as a rule) costs no timer.
            chunk = content.read_nowait()
            if not chunk:
                if content.at_eof():
                    break
                chunk = await _next_piece(content, idle_timeout_s, end - loop.time(), deadline_s)
                if not chunk:
                    break
            if decoder is not None:
                chunk = _inflate(decoder, chunk, limit - size)
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)
    # Bad chunked framing, or the body ended early (each server's own exception).
    except (web.RequestPayloadError, BodyError) as exc:
        raise client_error(f"malformed request body: {exc}", "invalid_body") from None
    if decoder is not None and not decoder.eof:
        raise client_error("compressed request body is truncated", "invalid_body")
    return b"".join(parts)


async def _next_piece(content: BodySource, idle_timeout_s: float, left_s: float, deadline_s: float) -> bytes:
    try:
        async with asyncio.timeout(min(idle_timeout_s, left_s)):
            piece: bytes = await content.readany()
            return piece
    except TimeoutError:
        if left_s <= idle_timeout_s:
            message = f"request body not received within {deadline_s:g} s (server.body_deadline_s)"
        else:
            message = f"request body not received: nothing arrived for {idle_timeout_s:g} s"
        raise client_error(message, "request_timeout", status=408) from None


def _inflate(decoder: Any, chunk: bytes, room: int) -> bytes:
    try:
        out: bytes = decoder.decompress(chunk, room + 1)
    except zlib.error:
        raise client_error("request body is not valid for its Content-Encoding", "invalid_body") from None
    if decoder.unused_data:
        raise client_error("data after the end of the compressed request body", "invalid_body")
    return out
