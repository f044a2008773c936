"""SharedTimeout: never early, at most a tick late, and told apart from a real cancellation."""

from __future__ import annotations

import asyncio

import pytest

from gateway.path.deadlines import SharedTimeout


async def test_wait_expires_after_its_timeout_not_before() -> None:
    shared = SharedTimeout(0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with shared.wait():
            await asyncio.Event().wait()
    elapsed = loop.time() - started
    assert 0.2 <= elapsed < 0.2 + 0.025 + 0.2  # one tick (seconds / 8) late at most, plus scheduling


async def test_finished_waits_leave_nothing_behind_and_later_ones_still_expire() -> None:
    shared = SharedTimeout(0.1)
    for _ in range(100):
        async with shared.wait():
            await asyncio.sleep(0)
    assert not shared._waits
    with pytest.raises(TimeoutError):
        async with shared.wait():
            await asyncio.Event().wait()


async def test_waits_registered_later_expire_in_order() -> None:
    shared = SharedTimeout(0.1)
    loop = asyncio.get_running_loop()
    ended: list[float] = []

    async def waiter() -> None:
        with pytest.raises(TimeoutError):
            async with shared.wait():
                await asyncio.Event().wait()
        ended.append(loop.time())

    first = asyncio.create_task(waiter())
    await asyncio.sleep(0.05)
    started_second = loop.time()
    await asyncio.gather(first, waiter())
    assert ended[1] - started_second >= 0.1


async def test_a_cancellation_is_not_a_timeout() -> None:
    shared = SharedTimeout(10)
    entered = asyncio.Event()

    async def waiter() -> None:
        async with shared.wait():
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(waiter())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not shared._waits


async def test_an_answer_in_time_is_not_cancelled_later() -> None:
    shared = SharedTimeout(0.05)
    async with shared.wait():
        await asyncio.sleep(0)
    await asyncio.sleep(0.15)  # past the deadline and a sweep: nothing may be cancelled now
    assert asyncio.current_task() is not None and asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
