"""Raw HTTP/1.1 over a loopback socket, for tests that must control every byte a client sends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson


@dataclass
class RawResponse:
    status: int
    headers: dict[str, list[str]] = field(default_factory=dict)  # lower-case names
    body: bytes = b""

    def header(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[-1] if values else None

    def json(self) -> object:
        return orjson.loads(self.body)


async def read_response(reader: asyncio.StreamReader) -> RawResponse:
    """One response from the stream (Content-Length, chunked, or until close)."""
    line = await reader.readline()
    if not line:
        raise ConnectionError("connection closed before a response")
    status = int(line.split(b" ", 2)[1])
    resp = RawResponse(status)
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        resp.headers.setdefault(name.strip().lower(), []).append(value.strip())
    if resp.header("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            parts.append(await reader.readexactly(size))
            await reader.readline()
        resp.body = b"".join(parts)
    elif resp.header("content-length") is not None:
        resp.body = await reader.readexactly(int(resp.header("content-length") or 0))
    else:
        resp.body = await reader.read()
    return resp


async def exchange(port: int, data: bytes, timeout: float = 10.0) -> RawResponse:
    """Send `data` on a fresh connection, read one response, close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout)
    finally:
        writer.close()


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the server closes the connection (EOF or reset) within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def post(path: str, body: bytes, *headers: str, host: str = "gw") -> bytes:
    """A POST with a Content-Length; `headers` are extra `Name: value` lines."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", *headers]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
