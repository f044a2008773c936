"""Arrival processes: open-loop Poisson, trace timestamps, or closed-loop with C clients.

Open loop means the schedule is fixed before the run and never waits for responses, so the
server's slowness cannot hide itself by slowing the client down. If the client itself falls
behind its schedule, the lag is recorded per request and the report says so.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import aiohttp

from bench import text
from bench.client import STATUS_TIMEOUT, ClientOptions, RequestRecord, send
from bench.workloads import BenchRequest

Mode = Literal["poisson", "closed", "trace"]
T = TypeVar("T")


@dataclass(slots=True)
class LoadSpec:
    mode: Mode = "poisson"
    rate: float | None = None  # requests/s, poisson
    concurrency: int | None = None  # clients, closed loop
    duration_s: float | None = None  # stop sending after this (measured from the first send)
    max_requests: int | None = None
    warmup_requests: int = 0  # the first N requests are sent but left out of the statistics
    warmup_s: float = 0.0  # and those scheduled before this offset
    drain_timeout_s: float = 120.0  # after the last send, how long in-flight requests may take
    seed: int = 0
    # Bursty Poisson: on/off phases at burst_high x and burst_low x the mean `rate`, the on phase
    # long enough that the mean stays `rate`; one on + off cycle lasts burst_period_s.
    burst_period_s: float | None = None
    burst_high: float = 2.0
    burst_low: float = 0.2

    def __post_init__(self) -> None:
        if self.mode == "poisson" and not (self.rate and self.rate > 0):
            raise ValueError("poisson arrivals need rate > 0")
        if self.mode == "closed" and not (self.concurrency and self.concurrency > 0):
            raise ValueError("closed-loop arrivals need concurrency > 0")
        if self.burst_period_s is not None and not (
            self.mode == "poisson" and self.burst_period_s > 0 and self.burst_low < 1.0 < self.burst_high
        ):
            raise ValueError("bursts need poisson arrivals, burst_period_s > 0, burst_low < 1 < burst_high")

    @property
    def label(self) -> str:
        if self.mode == "poisson" and self.burst_period_s is not None:
            high, low = self.burst_high, self.burst_low
            return f"{self.rate:g} req/s bursty {high:g}x/{low:g}x {self.burst_period_s:g}s"
        if self.mode == "poisson":
            return f"{self.rate:g} req/s"
        if self.mode == "closed":
            return f"C={self.concurrency}"
        return "trace"


@dataclass(slots=True)
class RunResult:
    load: LoadSpec
    records: list[RequestRecord]
    offered_rate: float | None  # requests/s the schedule asked for (None for closed loop)
    wall_s: float  # first send to last completion
    unsent: int = 0  # requests the limits left out
    notes: list[str] = field(default_factory=list)


def schedule(requests: list[BenchRequest], load: LoadSpec) -> list[float]:
    """Send offsets (s) for an open-loop run, one per request, cut by the duration limit."""
    if load.mode == "trace":
        if any(r.at is None for r in requests):
            raise ValueError("trace arrivals need a workload with timestamps (mooncake)")
        times = [r.at or 0.0 for r in requests]
        base = times[0] if times else 0.0
        times = [t - base for t in times]
    elif load.burst_period_s is not None:
        times = _bursty(len(requests), load)
    else:
        assert load.rate is not None
        rng = random.Random(f"arrivals:{load.seed}")
        times = list(itertools.accumulate((rng.expovariate(load.rate) for _ in requests), initial=0.0))[:-1]
    if load.duration_s is not None:
        times = [t for t in times if t < load.duration_s]
    return times


def _bursty(n: int, load: LoadSpec) -> list[float]:
    """n arrivals of a Poisson process whose rate switches between high and low phases (starting
    high): each gap is a unit exponential of intensity, spent across phase boundaries."""
    assert load.rate is not None and load.burst_period_s is not None
    period = load.burst_period_s
    # on * high + (period - on) * low = period * rate
    on = (1.0 - load.burst_low) / (load.burst_high - load.burst_low) * period
    phases = [(load.rate * load.burst_high, on), (load.rate * load.burst_low, period - on)]
    rng = random.Random(f"arrivals:{load.seed}")
    times: list[float] = []
    start, k, t = 0.0, 0, 0.0  # the current phase began at `start`; t is within it
    for _ in range(n):
        times.append(t)
        need = rng.expovariate(1.0)
        while True:
            rate, length = phases[k]
            left = start + length - t
            if need <= rate * left:
                t += need / rate
                break
            need -= rate * left
            start += length
            t = start
            k = 1 - k
    return times


def _limit(requests: list[BenchRequest], load: LoadSpec) -> list[BenchRequest]:
    return requests if load.max_requests is None else requests[: load.max_requests]


def _new_record(req: BenchRequest, load: LoadSpec, scheduled: float) -> RequestRecord:
    return RequestRecord(
        index=req.index,
        kind=req.kind,
        priority=req.priority,
        group=req.group,
        target="",
        scheduled=scheduled,
        warmup=req.index < load.warmup_requests or scheduled < load.warmup_s,
    )


async def drain(tasks: list[asyncio.Task[Any]], timeout_s: float) -> int:
    """Wait up to `timeout_s` for the requests in flight, then cancel the rest (`send` records them
    as running at the drain deadline, before a closing session would cut them as disconnects);
    how many were cancelled."""
    if not tasks:
        return 0
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh event loop: uvloop when installed (the client then keeps its
    schedule at higher rates), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


class TargetError(RuntimeError):
    """A target failed the priming request: it is not serving this model."""


async def prime(session: aiohttp.ClientSession, targets: list[str], opts: ClientOptions, n: int) -> None:
    """Send n tiny unique requests first, round-robin over the targets, so that lazy start-up
    costs (imports, tokenizer load, first connections) do not land on measured requests."""
    for i in range(n):
        req = BenchRequest(
            index=-1 - i,
            messages=[{"role": "user", "content": text.words(f"prime:{time.time_ns()}:{i}", 8)}],
            max_tokens=2,
            prompt_tokens=8,
        )
        target = targets[i % len(targets)]
        record = RequestRecord(index=req.index, kind="prime", priority=None, group=None, target=target)
        await send(session, target, req, opts, record, time.perf_counter())
        if not record.ok:
            raise TargetError(f"priming request to {target} failed: status {record.status}: {record.error}")


async def run(
    requests: list[BenchRequest],
    load: LoadSpec,
    targets: list[str],
    opts: ClientOptions,
    prime_requests: int = 0,
) -> RunResult:
    """Send the workload to `targets` (round-robin when there are several) and measure it."""
    if not targets:
        raise ValueError("no target URL")
    chosen = _limit(requests, load)
    done = {r.index: asyncio.Event() for r in chosen}
    # Without a limit on connections, the client never queues requests itself.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        await prime(session, targets, opts, prime_requests)
        t0 = time.perf_counter()
        records: list[RequestRecord] = []
        target_cycle = itertools.cycle(targets)

        tasks: list[asyncio.Task[None]] = []

        async def one(req: BenchRequest, scheduled: float) -> None:
            record = _new_record(req, load, scheduled)
            records.append(record)
            try:
                if req.depends_on is not None and req.depends_on in done:
                    await done[req.depends_on].wait()
                record.ready = max(scheduled, time.perf_counter() - t0)
                await send(session, next(target_cycle), req, opts, record, t0)
            except asyncio.CancelledError:
                if record.error is None:
                    record.status, record.error = STATUS_TIMEOUT, "cancelled before it was sent"
                raise
            finally:
                done[req.index].set()

        def spawn(req: BenchRequest, scheduled: float) -> asyncio.Task[None]:
            task = asyncio.create_task(one(req, scheduled))
            tasks.append(task)
            return task

        if load.mode == "closed":
            sent, last_send = await _closed_loop(chosen, load, spawn, t0)
        else:
            sent, last_send = await _open_loop(chosen, load, spawn, t0)
        notes: list[str] = []
        if load.duration_s is not None and sent == len(chosen) and last_send < 0.9 * load.duration_s:
            # Not an error, but the run was shorter than asked: say so rather than let it pass.
            notes.append(
                f"the workload's {len(chosen)} requests ran out after {last_send:.1f} s "
                f"of the {load.duration_s:g} s duration"
            )
        if unfinished := await drain(tasks, load.drain_timeout_s):
            notes.append(
                f"{unfinished} requests still running {load.drain_timeout_s:g} s after the last send"
            )
        wall = time.perf_counter() - t0
    for record in records:
        if record.status == STATUS_TIMEOUT and record.e2e is None and record.sent is not None:
            record.e2e = wall - record.sent
    records.sort(key=lambda r: r.index)
    offered = None
    if load.mode == "poisson":
        offered = load.rate
    elif load.mode == "trace" and sent > 1 and last_send > 0:
        offered = (sent - 1) / last_send
    return RunResult(
        load=load, records=records, offered_rate=offered, wall_s=wall, unsent=len(chosen) - sent, notes=notes
    )


Spawn = Callable[[BenchRequest, float], "asyncio.Task[None]"]


async def _open_loop(
    chosen: list[BenchRequest], load: LoadSpec, spawn: Spawn, t0: float
) -> tuple[int, float]:
    times = schedule(chosen, load)
    for req, at in zip(chosen, times, strict=False):
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        spawn(req, at)
    return len(times), (times[-1] if times else 0.0)


async def _closed_loop(
    chosen: list[BenchRequest], load: LoadSpec, spawn: Spawn, t0: float
) -> tuple[int, float]:
    queue = iter(chosen)
    sent = 0
    last = 0.0

    async def client() -> None:
        nonlocal sent, last
        for req in queue:
            now = time.perf_counter() - t0
            if load.duration_s is not None and now >= load.duration_s:
                return
            sent += 1
            last = now
            await spawn(req, now)

    assert load.concurrency is not None
    await asyncio.gather(*(client() for _ in range(load.concurrency)))
    return sent, last
