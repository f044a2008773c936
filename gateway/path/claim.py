"""One attempt's hold on a replica: its breaker admission and its load, settled exactly once.

Every attempt on a replica (the proxy's, both PD legs) runs inside `with Claim.take(...)`:
leaving the block, whatever ends it (an answer, an error, a timeout, the client going away,
a task cancelled before it ever ran), releases the load and, unless a verdict was given,
frees the half-open probe. So no path can leave a circuit waiting forever on a probe that
nobody will settle.

The verdicts follow one rule (docs/untrusted-peers.md, "Retries, circuit breaking and engine
connections"): `answered` when the
engine formed an HTTP answer, whatever its status; `failed` for transport failures only
(refused or timed-out connects, connections closed before or while answering, malformed
responses, timeouts). A well-formed 500 is not held against the replica: vLLM answers 500
both for a request that failed on its own (`EngineGenerateError`, e.g. bad input) and when
its engine died, and any client can provoke the first; a dead engine is caught by what the
client cannot cause: its server exits (transport failures) and `/health` answers 503.
"""

from __future__ import annotations

from types import TracebackType

from gateway.fleet.breaker import Admission
from gateway.fleet.replica import Lease, Replica


class Claim:
    __slots__ = ("_admission", "_lease", "replica")

    def __init__(self, replica: Replica, admission: Admission, tokens: int) -> None:
        self.replica = replica
        self._admission = admission
        self._lease: Lease | None = replica.lease(tokens)

    @classmethod
    def take(cls, replica: Replica, tokens: int) -> Claim | None:
        """Admit one attempt through the replica's breaker, or None when its circuit refuses."""
        admission = replica.breaker.try_acquire()
        return cls(replica, admission, tokens) if admission else None

    def answered(self) -> None:
        self.replica.breaker.record_success(self._admission)
        self._admission = Admission.ADMITTED

    def failed(self) -> None:
        self.replica.breaker.record_failure(self._admission)
        # A later verdict on the same attempt (a stream cut short after its headers) counts as
        # any closed-circuit outcome: the probe's own verdict was the first one.
        self._admission = Admission.ADMITTED

    def close(self) -> None:
        """Release the load and an unsettled probe; idempotent."""
        lease, self._lease = self._lease, None
        if lease is None:
            return
        lease.release()
        self.replica.breaker.release(self._admission)  # a no-op once a verdict was given

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
