"""One GPU time-sliced among several simulated replicas of one process, as separate engine processes
share a GPU without MPS.

Their kernels never overlap: the driver gives the device to one context at a time, in slices of a few
milliseconds, round robin over the contexts that have work. At the scale of an engine step that is
processor sharing: while k replicas have kernels queued, each progresses at 1/k of the GPU's speed, and
a replica alone busy gets all of it. A virtual clock models that exactly (as in fair queueing): V
advances by 1/k device-seconds per second while k jobs are active, and a job of w device-seconds that
starts when V = v finishes when V reaches v + w, whoever starts or finishes meanwhile.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class SharedDevice:
    def __init__(self) -> None:
        self._v = 0.0  # device-seconds every active job has received since the device was created
        self._at = 0.0  # the loop time _v is up to date for
        self._active: list[tuple[float, int]] = []  # (finish tag, job), a heap
        self._done: dict[int, float] = {}  # job -> loop time it finished, until its runner collects it
        self._seq = itertools.count()
        self._changed = asyncio.Event()  # replaced after each set: a broadcast to every waiting job

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _advance(self, now: float) -> None:
        """Bring V up to loop time `now`, retiring on the way (at their exact times) the jobs it completes.
        Never backwards: a step may start a little ahead of loop.time(), whose clock (uvloop's) ticks in
        milliseconds, and a late runner's step cannot start before the device's last change."""
        now = max(now, self._at)
        act = self._active
        retired = False
        while act:
            tag, job = act[0]
            end = self._at + (tag - self._v) * len(act)
            if end > now:
                break
            heapq.heappop(act)
            self._v, self._at = tag, end
            self._done[job] = end
            retired = True
        if act:
            self._v += (now - self._at) / len(act)
        self._at = now
        if retired:
            self._notify()  # the others now share among fewer: they finish sooner than they expected

    async def run(self, work_s: float, start: float) -> float:
        """Do `work_s` seconds of whole-GPU work from loop time `start`; returns the loop time it finished."""
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
                eta = self._at + (tag - self._v) * len(self._active)
                try:
                    await asyncio.wait_for(self._changed.wait(), max(eta - loop.time(), 0.0))
                except TimeoutError:
                    pass
        except asyncio.CancelledError:  # the runner stopped: its work leaves the device unfinished
            self._done.pop(job, None)
            if (tag, job) in self._active:
                self._active.remove((tag, job))
                heapq.heapify(self._active)
                self._notify()
            raise
