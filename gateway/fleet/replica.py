"""One engine replica as the gateway sees it: address, role, health, breaker and live load.

In-flight load is counted once, here: `inflight_requests`/`inflight_tokens` are this gateway's
requests on the replica, changed only by a `Lease` (which every attempt takes through
gateway.path.claim). Everything else reads these counts: the admission headroom per replica,
the policies, and the shared state backend, which publishes them for the other gateway
instances and writes theirs into `remote_inflight_*` (their requests, not a second count of
ours). Two counts beside it measure other things: the scheduler's tickets count requests per
pool from admission to the end of dispatch, including the moments they hold no lease (while
ranked, during a PD prefill leg, between retries), so that a pool's in-flight budget is not
overrun by requests admitted but not yet leased; and a policy's own ledger (prefix_affinity's)
keeps each request's uncached tokens, and drops entries as the replica's count falls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from gateway.fleet.breaker import BreakerState, CircuitBreaker
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.replica_speed import ReplicaSpeed

Role = Literal["mixed", "prefill", "decode"]


class Replica:
    """Mutable state of a replica. Policies only read it (through the same attributes); an
    attempt changes its load through `Lease`, the health checker its `healthy` flag."""

    __slots__ = (
        "bootstrap_port",
        "breaker",
        "device",
        "draining",
        "engine",
        "healthy",
        "inflight_requests",
        "inflight_tokens",
        "kind",
        "kv_side_channel_host",
        "kv_side_channel_ports",
        "managed",
        "name",
        "on_eject",
        "pool",
        "remote_inflight_requests",
        "remote_inflight_tokens",
        "role",
        "speed",
        "stale_after_s",
        "total_requests",
        "url",
    )

    def __init__(
        self,
        name: str,
        url: str,
        pool: str,
        *,
        role: Role = "mixed",
        kind: str = "vllm",
        breaker: CircuitBreaker,
        bootstrap_port: int | None = None,
        managed: bool = False,
        healthy: bool = True,
        stale_after_s: float = 3.0,
        device: str | None = None,
        kv_side_channel_host: str | None = None,
        kv_side_channel_ports: range | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.pool = pool
        self.role: Role = role
        self.kind = kind
        self.breaker = breaker
        self.bootstrap_port = bootstrap_port
        self.managed = managed
        # Replicas naming the same device time-share one GPU (None: a device of its own).
        self.device = device
        # The host a vLLM prefill replica names for its KV (VLLM_NIXL_SIDE_CHANNEL_HOST), where
        # known: a prefill answer naming another is not relayed to a decode replica.
        # Where a prefill answer may tell a decode engine to fetch this replica's KV: the host its
        # engine was given (else its URL's), and the ports where known (launched engines).
        self.kv_side_channel_host = kv_side_channel_host or urlsplit(url).hostname
        self.kv_side_channel_ports = kv_side_channel_ports
        self.healthy = healthy
        self.draining = False
        self.inflight_requests = 0
        self.inflight_tokens = 0
        # Other gateway instances' in-flight load here (shared state backend; 0 when alone).
        self.remote_inflight_requests = 0
        self.remote_inflight_tokens = 0
        self.total_requests = 0
        self.engine = EngineLoad()
        self.speed = ReplicaSpeed()  # measured by the proxy from completed requests
        self.stale_after_s = stale_after_s
        # Called when health checks eject the replica: answers it still streams are cut there.
        self.on_eject: set[Callable[[], None]] = set()

    def eject(self) -> None:
        """Out of rotation (failed health checks): the answers it is streaming learn at once,
        rather than after the idle timeout, so that they can be continued elsewhere."""
        self.healthy = False
        for cut in list(self.on_eject):
            cut()

    @property
    def available(self) -> bool:
        """Eligible for new requests: healthy, not draining, circuit not refusing."""
        return self.healthy and not self.draining and self.breaker.allows()

    @property
    def circuit(self) -> BreakerState:
        return self.breaker.state

    @property
    def engine_fresh(self) -> bool:
        return self.engine.is_fresh(self.stale_after_s)

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self.engine.kv_capacity_tokens

    def lease(self, tokens: int) -> Lease:
        self.inflight_requests += 1
        self.inflight_tokens += tokens
        self.total_requests += 1
        return Lease(self, tokens)

    def __repr__(self) -> str:
        return f"Replica({self.name!r}, {self.url!r}, role={self.role}, healthy={self.healthy})"


@dataclass(slots=True)
class Lease:
    """The load one request puts on a replica; released exactly once whatever ends it."""

    replica: Replica
    tokens: int
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.replica.inflight_requests -= 1
        self.replica.inflight_tokens -= self.tokens
