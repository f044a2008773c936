"""Fault injection: per request through the `x-sim-fault` header, or at random through CLI flags.

Header syntax: comma-separated items, applied together:
  status=CODE    answer CODE with an error body (no generation)
  stall=SECONDS  wait SECONDS (wall clock, not divided by --speedup) before sending response headers
  midstream=N    (streaming) send N SSE chunks, then drop the connection without `data: [DONE]`
  crash          the engine dies at once: the process exits (or, with --replicas, that replica's port closes)
  lease_stall=SECONDS  (a PD prefill leg) the decode replica's fetch of this request's KV waits
                 SECONDS first: a prefill replica that hangs once the decode asked for the KV
e.g. `x-sim-fault: stall=2,status=503`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

HEADER = "x-sim-fault"


class FaultSyntaxError(ValueError):
    pass


@dataclass(slots=True)
class FaultSpec:
    status: int | None = None
    stall_s: float = 0.0
    midstream: int | None = None
    crash: bool = False
    lease_stall_s: float = 0.0

    @classmethod
    def parse(cls, header: str) -> FaultSpec:
        spec = cls()
        for item in header.split(","):
            key, _, value = item.strip().partition("=")
            try:
                if key == "status":
                    spec.status = int(value)
                elif key == "stall":
                    spec.stall_s = float(value)
                elif key == "midstream":
                    spec.midstream = int(value)
                elif key == "crash":
                    spec.crash = True
                elif key == "lease_stall":
                    spec.lease_stall_s = float(value)
                elif key:
                    raise FaultSyntaxError(f"unknown {HEADER} item {key!r}")
            except ValueError as exc:
                raise FaultSyntaxError(f"bad {HEADER} item {item.strip()!r}: {exc}") from None
        return spec


@dataclass
class FaultConfig:
    """Random faults for every generation request (CLI: --fault-*)."""

    error_rate: float = 0.0
    error_status: int = 500
    stall_rate: float = 0.0
    stall_s: float = 0.0
    crash_after: int | None = None  # after this many generation requests, the next one kills the engine
    seed: int = 0
    kv_drop_rate: float = 0.0  # KV event batches numbered and kept for replay but not sent (a gap)
    kv_reorder_rate: float = 0.0  # KV event batches sent after the next one

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._count = 0

    def draw(self) -> FaultSpec:
        spec = FaultSpec()
        self._count += 1
        if self.crash_after is not None and self._count > self.crash_after:
            spec.crash = True
        if self.error_rate and self._rng.random() < self.error_rate:
            spec.status = self.error_status
        if self.stall_rate and self._rng.random() < self.stall_rate:
            spec.stall_s = self.stall_s
        return spec
