"""A TCP relay in front of an engine that breaks one answer at a chosen byte, for failover tests.

Each relay forwards connections to its target untouched. Relays share a `Trigger`: armed with a
byte count, the next bytes of answers to POST requests through any of them are counted (health
checks and metric scrapes pass by), and the connection carrying
the answer is reset (RST, both sides) once that many bytes passed, the last piece cut there. It
fires once per arming, so the replica that continues the answer is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class Trigger:
    """One cut: at the `at`-th response byte after arming (counted over all relays sharing it)."""

    def __init__(self) -> None:
        self.left: int | None = None
        self.fired = 0

    def arm(self, at: int) -> None:
        self.left = at

    def disarm(self) -> None:
        self.left = None


class CutRelay:
    def __init__(self, target: str, trigger: Trigger) -> None:
        host, _, port = target.removeprefix("http://").rpartition(":")
        self.target = (host, int(port))
        self.trigger = trigger
        self.server: asyncio.Server | None = None
        self.url = ""
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> CutRelay:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for task in self._conns:  # keep-alive connections the gateway still holds
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self.server.wait_closed()

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(c_writer)
            return
        posting = [False]  # the connection's current request is a POST
        up = asyncio.ensure_future(_pump(c_reader, u_writer, posting))
        try:
            while data := await u_reader.read(65536):
                left = self.trigger.left if posting[0] else None
                if left is not None and len(data) >= left:
                    self.trigger.left = None
                    self.trigger.fired += 1
                    c_writer.write(data[:left])
                    with contextlib.suppress(ConnectionError):
                        await c_writer.drain()
                    _reset(c_writer)
                    _reset(u_writer)
                    return
                if left is not None:
                    self.trigger.left = left - len(data)
                c_writer.write(data)
                await c_writer.drain()
        except ConnectionError:
            pass
        finally:
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)
            for w in (c_writer, u_writer):
                w.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, posting: list[bool]) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            if data[:1].isalpha():  # a request's first bytes (a client sends one at a time)
                posting[0] = data.startswith(b"POST ")
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST: what a killed engine's kernel sends."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
