"""Bytes a peer sent that nobody has read yet, with flow control: both of kvgate's hand-written HTTP
ends buffer a message body this way (the httptools server a client's request body, the http1
client an engine's answer).

Reading from the socket pauses once more than `high_water` bytes wait, and resumes as soon as they
are taken, so a peer that sends faster than the gateway reads fills a bounded buffer, not memory.
A reader waits for bytes with `wait`; whoever feeds or ends the body `wake`s it, or fails it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Inflow:
    __slots__ = ("_high_water", "_parts", "_pause", "_paused", "_resume", "_size", "_waiter")

    def __init__(self, high_water: int, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._high_water = high_water
        self._pause, self._resume = pause, resume  # the transport's pause_reading, resume_reading
        self._parts: list[bytes] = []
        self._size = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    def __bool__(self) -> bool:
        """Whether bytes wait to be read."""
        return bool(self._parts)

    @property
    def waiting(self) -> bool:
        """Whether a reader waits for bytes."""
        return self._waiter is not None

    def feed(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size > self._high_water and not self._paused:
            self._paused = True
            self._pause()
        self.wake()

    def take(self) -> bytes:
        """Every byte waiting (b"" for none); reading resumes if it had paused."""
        parts = self._parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        self._size = 0
        if self._paused:
            self._paused = False
            self._resume()
        return data

    def clear(self) -> None:
        """Forget what waits (a new message on the same connection)."""
        self._parts.clear()
        self._size = 0

    async def wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until the next `wake` (bytes, the body's end) or `fail`."""
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
