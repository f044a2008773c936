"""Timeouts shared by many waits, swept on a tick instead of one event-loop timer per wait.

Arming and cancelling a loop timer costs 2-3 us on uvloop (asyncio.timeout: 3.4 us a wait), paid
on every request and every streamed chunk though almost none of them ever expires. Waits under one
`SharedTimeout` all last the same `seconds`, so registration order is deadline order: a wait costs
a dict insert and delete, and one sweep per tick (an eighth of the timeout, 10-500 ms) cancels the
expired ones from the front of the dict. A wait may so expire up to one tick late; it is never
early. Cancellation is told apart from expiry as asyncio.timeout does it (the task's cancel count),
so a client that leaves still cancels the waiting task, and an expired wait raises TimeoutError.
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType


class SharedTimeout:
    """One timeout value for many waits: `async with shared.wait():` raises TimeoutError after
    `seconds` (at most one tick more)."""

    __slots__ = ("_loop", "_loop_thread", "_sweeper", "_tick", "_waits", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._tick = max(0.01, min(0.5, seconds / 8))
        self._waits: dict[_Wait, float] = {}  # insertion order is deadline order
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the sweeper's
        self._loop_thread = 0  # the sweeper's loop's

    def wait(self) -> _Wait:
        return _Wait(self)

    def _add(self, wait: _Wait, loop: asyncio.AbstractEventLoop) -> None:
        self._waits[wait] = loop.time() + self.seconds
        if self._sweeper is None or self._loop is not loop:  # a sweeper on a closed loop never runs
            self._loop, self._loop_thread = loop, threading.get_ident()
            self._sweeper = loop.call_later(self._tick, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        waits = self._waits
        if not waits:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for wait, deadline in list(waits.items()):
            if deadline > now:
                break
            del waits[wait]
            wait.expire()
        if waits:
            self._sweeper = loop.call_later(self._tick, self._sweep)


class _Wait:
    __slots__ = ("_cancelling", "_expired", "_owner", "_task")

    def __init__(self, owner: SharedTimeout) -> None:
        self._owner = owner
        self._expired = False

    async def __aenter__(self) -> None:
        # The sweeper's loop first, when it runs on this thread: on Python 3.11 get_running_loop()
        # is a getpid() system call. One with no task current is not running: then it is looked up.
        owner = self._owner
        loop = owner._loop
        here = loop is not None and owner._loop_thread == threading.get_ident()
        task = asyncio.current_task(loop) if here else None
        if task is None or loop is None:  # (no task without a loop: the second test is for the type checker)
            loop = asyncio.get_running_loop()
            task = asyncio.current_task(loop)
            if task is None:
                raise RuntimeError("a timeout needs a task")
        self._task = task
        self._cancelling = task.cancelling()
        owner._add(self, loop)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._expired:
            del self._owner._waits[self]
            return
        # Ours unless someone else cancelled the task too (as asyncio.Timeout decides).
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def expire(self) -> None:
        self._expired = True
        self._task.cancel()
