"""One GPU time-sliced among several simulated replicas of one process, as separate engine processes
share a GPU without MPS.

Their kernels never overlap: the driver gives the device to one context at a time, in slices of a few
milliseconds, round robin over the contexts that have work. At the scale of an engine step that is
processor sharing: while k replicas have steps in progress each progresses at 1/k of the GPU's speed,
and a replica alone busy gets all of it. A whole step is shared, its launch and synchronization gaps
included, not only its kernels' roofline time: a context keeps its slice through short gaps, and the
2026-12-01 H200 run (four vLLMs on one GPU) fits that and not the kernels alone. Context switches cost
a fraction of the time while more than one replica has work (the profile's `timeslice_efficiency`).

A virtual clock models it exactly (as in fair queueing): V advances by `rate(k)` seconds of a lone GPU
per second while k steps are in progress, and a step of w seconds that starts when V = v finishes when
V reaches v + w, whoever starts or finishes meanwhile.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class SharedDevice:
    def __init__(self, efficiency: float = 1.0) -> None:
        self.efficiency = efficiency
        self._v = 0.0  # lone-GPU seconds every active step has received since the device was created
        self._at = 0.0  # the loop time _v is up to date for
        self._active: list[tuple[float, int]] = []  # (finish tag, job), a heap
        self._done: dict[int, float] = {}  # job -> loop time it finished, until its runner collects it
        self._seq = itertools.count()
        self._changed = asyncio.Event()  # replaced after each set: a broadcast to every waiting job

    def _rate(self) -> float:
        """Progress of each active step per second."""
        k = len(self._active)
        return 1.0 if k == 1 else self.efficiency / k

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _advance(self, now: float) -> None:
        """Bring V up to loop time `now`, retiring on the way (at their exact times) the steps it completes.
        Never backwards: a step may start a little ahead of loop.time(), whose clock (uvloop's) ticks in
        milliseconds, and a late runner's step cannot start before the device's last change."""
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
            self._done[job] = end
            retired = True
        if act:
            self._v += (now - self._at) * self._rate()
        self._at = now
        if retired:
            self._notify()  # the others now share among fewer: they finish sooner than they expected

    async def run(self, work_s: float, start: float) -> float:
        """A step of `work_s` seconds on a lone GPU, from loop time `start`; returns the loop time it ends."""
        loop = asyncio.get_running_loop()
        self._advance(start)
        job = next(self._seq)
        tag = self._v + work_s
        heapq.heappush(self._active, (tag, job))
        self._notify()
        try:
            while True:
                self._advance(loop.time())
                if job in self._done:
                    return self._done.pop(job)
                eta = self._at + (tag - self._v) / self._rate()
                try:
                    await asyncio.wait_for(self._changed.wait(), max(eta - loop.time(), 0.0))
                except TimeoutError:
                    pass
        except asyncio.CancelledError:  # the runner stopped: its step leaves the device unfinished
            self._done.pop(job, None)
            if (tag, job) in self._active:
                self._active.remove((tag, job))
                heapq.heapify(self._active)
                self._notify()
            raise
