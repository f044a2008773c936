"""A client's request body, read and parsed within bounds: size, time between reads, content coding
and JSON nesting. Every violation is the client's: a 4xx in the OpenAI error form.

Content codings: `gzip` (and `x-gzip`) and `deflate` bodies are decompressed as they arrive, and
`server.max_body_bytes` bounds the decompressed size, so a small compressed body cannot expand into
a large one (a zip bomb stops at the limit); `identity` is the default; any other coding is 415.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import orjson
from aiohttp import web

from gateway.errors import GatewayError

# gzip or zlib-wrapped deflate, told apart by the stream's own header.
_ZLIB_AUTO = 32 + zlib.MAX_WBITS
_DECODED = frozenset({"gzip", "x-gzip", "deflate"})


def client_error(message: str, code: str, param: str | None = None, status: int = 400) -> GatewayError:
    return GatewayError(status, message, "invalid_request_error", code, param)


def _too_large(limit: int) -> GatewayError:
    return client_error(f"request body exceeds {limit} bytes", "request_too_large", status=413)


def _decoder(request: web.Request) -> Any:
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


async def read_body(request: web.Request, limit: int, idle_timeout_s: float) -> bytes:
    """The body, decoded, at most `limit` bytes; the client may pause at most `idle_timeout_s`
    between two pieces of it."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit)
    decoder = _decoder(request)
    content = request.content
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            # What has arrived already (all of a small body, as a rule) costs no timer.
            chunk = content.read_nowait()
            if not chunk:
                if content.at_eof():
                    break
                chunk = await _next_piece(content, idle_timeout_s)
                if not chunk:
                    break
            if decoder is not None:
                chunk = _inflate(decoder, chunk, limit - size)
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)
    except web.RequestPayloadError as exc:  # bad chunked framing, or the body ended early
        raise client_error(f"malformed request body: {exc}", "invalid_body") from None
    if decoder is not None and not decoder.eof:
        raise client_error("compressed request body is truncated", "invalid_body")
    return b"".join(parts)


async def _next_piece(content: Any, idle_timeout_s: float) -> bytes:
    try:
        async with asyncio.timeout(idle_timeout_s):
            piece: bytes = await content.readany()
            return piece
    except TimeoutError:
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


def parse_json_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    if not raw:
        raise client_error("request body is empty; expected a JSON object", "invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise client_error(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise client_error("request body must be a JSON object", "invalid_json")
    # Arrays and objects nested this deep are no API's shape; past it the gateway could not
    # re-serialize the body (orjson stops at 255 levels).
    if raw.count(b"[") + raw.count(b"{") > max_depth and nesting_exceeds(body, max_depth):
        raise client_error(f"request body nests JSON deeper than {max_depth} levels", "invalid_json")
    return body


def nesting_exceeds(doc: Any, limit: int) -> bool:
    """Whether arrays and objects in `doc` nest more than `limit` deep (the document itself is 1)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False
