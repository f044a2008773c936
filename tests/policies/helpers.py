"""Hand-built routing inputs for policy unit tests: real Replica objects, no gateway around them."""

from __future__ import annotations

import itertools
import time

from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.replica import Lease, Replica
from gateway.routing.policy import Candidate, Outcome, Policy, ReplicaView, RequestFeatures

_ids = itertools.count()


def replicas(n: int) -> list[Replica]:
    return [
        Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}", "p", breaker=CircuitBreaker(3, 5.0))
        for i in range(n)
    ]


def request(
    prompt_tokens: int = 2176, text: str = "", headers: dict[str, str] | None = None, stream: bool = False
) -> RequestFeatures:
    return RequestFeatures(
        request_id=f"req-{next(_ids)}",
        model="m",
        pool="p",
        endpoint="chat",
        prompt_tokens=prompt_tokens,
        stream=stream,
        text=text,
        headers=headers or {},
    )


def candidates(reps: list[Replica], matched: dict[str, int] | None = None) -> list[Candidate]:
    """One candidate per replica; `matched` gives a replica's matched tokens (16 per block)."""
    matched = matched or {}
    return [Candidate(r, matched.get(r.name, 0) // 16, matched.get(r.name, 0)) for r in reps]


def engine_report(replica: Replica, waiting: int = 0, running: int = 0) -> None:
    """A fresh engine load figure, as the scraper would store it."""
    replica.engine = EngineLoad(waiting=waiting, running=running, updated_at=time.monotonic())


def send(replica: Replica, features: RequestFeatures) -> Lease:
    """What the proxy does once a replica is chosen: take the in-flight lease."""
    return replica.lease(features.prompt_tokens)


def complete(policy: Policy, features: RequestFeatures, replica: ReplicaView | None) -> None:
    """What the proxy does once the request has ended: tell the policy, once."""
    outcome = Outcome(
        ok=True,
        status=200,
        error=None,
        ttft_s=0.01,
        e2e_s=0.1,
        prompt_tokens=features.prompt_tokens,
        cached_tokens=None,
        attempts=1,
    )
    policy.on_complete(features, replica, outcome)


def decide(policy: Policy, features: RequestFeatures, offered: list[Candidate]) -> list[Candidate]:
    """A decision only (its request ends at once, never holding a replica): ranked, then completed."""
    ranked = policy.rank(features, offered)
    complete(policy, features, ranked[0].replica if ranked else None)
    return ranked
