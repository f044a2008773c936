"""One GPU time-sliced among several simulated replicas, as separate engine processes share a GPU
without MPS.

Their kernels never overlap: the driver gives the device to one context at a time, in slices of a few
milliseconds, round robin over the contexts that have work. At the scale of an engine step that is
processor sharing: while k replicas have steps in progress each progresses at 1/k of the GPU's speed,
and a replica alone busy gets all of it. A whole step is shared, its launch and synchronization gaps
included, not only its kernels' roofline time: a context keeps its slice through short gaps, and the
2026-12-01 H200 run (four vLLMs on one GPU) fits that and not the kernels alone. Context switches cost
a fraction of the time while more than one replica has work (the profile's `timeslice_efficiency`).

`TimeSlicedGPU` is that model on any clock (bench.sim_calibration runs it on a virtual one; at efficiency
1 it is plain processor sharing, which is also how a decode replica's KV transfers share its link, engine.py);
`SharedDevice` runs it on the event loop's clock for the replicas of one simulator process.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class TimeSlicedGPU:
    """Processor sharing by a virtual clock (as in fair queueing): V advances by `rate(k)` seconds of a
    lone GPU per second while k steps are in progress, and a step of w seconds that starts when V = v
    finishes when V reaches v + w, whoever starts or finishes meanwhile."""

    def __init__(self, efficiency: float = 1.0) -> None:
        self.efficiency = efficiency
        self.done: dict[int, float] = {}  # job -> when it finished, until its owner collects it
        self._v = 0.0  # lone-GPU seconds every active step has received
        self._at = 0.0  # the time _v is up to date for
        self._active: list[tuple[float, int]] = []  # (finish tag, job), a heap

    def _rate(self) -> float:
        """Progress of each active step per second."""
        k = len(self._active)
        return 1.0 if k == 1 else self.efficiency / k

    def advance(self, now: float) -> bool:
        """Bring V up to `now`, moving the steps it completes to `done` at their exact end times; True if any.
        Never backwards: a late caller cannot start a step before the device's last change."""
        now = max(now, self._at)
        act = self._active
        retired = False
        while act:
            tag, job = act[0]
            end = self._at + (tag - self._v) / self._rate()
            if end > now:
                break
            heapq.heappop(act)
            self._v, self._at = tag, end
            self.done[job] = end
            retired = True
        if act:
            self._v += (now - self._at) * self._rate()
        self._at = now
        return retired

    def start(self, job: int, work_s: float, at: float) -> bool:
        """A step of `work_s` seconds on a lone GPU from time `at`; returns `advance`'s answer."""
        retired = self.advance(at)
        heapq.heappush(self._active, (self._v + work_s, job))
        return retired

    def cancel(self, job: int) -> None:
        self.done.pop(job, None)
        self._active = [(tag, j) for tag, j in self._active if j != job]
        heapq.heapify(self._active)

    def next_end(self) -> float | None:
        """When the next step in progress ends, if no other starts meanwhile."""
        if not self._active:
            return None
        return self._at + (self._active[0][0] - self._v) / self._rate()


class SharedDevice:
    """A TimeSlicedGPU on the event loop's clock, shared by the step runners of one process."""

    def __init__(self, efficiency: float = 1.0) -> None:
        self._gpu = TimeSlicedGPU(efficiency)
        self._seq = itertools.count()
        self._changed = asyncio.Event()  # replaced after each set: a broadcast to every waiting step

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self, work_s: float, start: float) -> float:
        """A step of `work_s` seconds on a lone GPU, from loop time `start` (which may be a little ahead
        of loop.time(): uvloop's clock ticks in milliseconds); returns the loop time it ends."""
        loop = asyncio.get_running_loop()
        gpu = self._gpu
        job = next(self._seq)
        gpu.start(job, work_s, start)
        self._notify()  # the others now share among more: they finish later than they expected
        try:
            while True:
                if gpu.advance(loop.time()):
                    self._notify()  # ... or among fewer, sooner
                if job in gpu.done:
                    return gpu.done.pop(job)
                eta = gpu.next_end()
                timeout = 0.0 if eta is None else max(eta - loop.time(), 0.0)
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout)
                except TimeoutError:
                    pass
        except asyncio.CancelledError:  # the runner stopped: its step leaves the device unfinished
            gpu.cancel(job)
            self._notify()
            raise
