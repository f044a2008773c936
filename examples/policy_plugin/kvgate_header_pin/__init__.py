"""header_pin: an example kvgate routing-policy plugin (plugin API version 2).

A request whose header (default `x-pin-replica`) names a replica goes there first (e.g. to
reproduce a problem on one engine); every other request, and the fallbacks of a pinned one,
go to the replicas with the least work in flight (the built-ins' load scorer). How each pinned
request ended is logged, from the completion hook: pinning is for watching one engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import (
    API_VERSION,
    Candidate,
    LoadScorer,
    Outcome,
    Policy,
    ReplicaView,
    RequestFeatures,
    rank_by,
)

if API_VERSION < 2:
    raise ImportError("kvgate_header_pin needs kvgate's routing-policy API version 2 or later")

log = logging.getLogger(__name__)


class HeaderPinParams(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt argument is an error at startup
    header: str = Field("x-pin-replica", min_length=1, description="Request header naming the replica")


class HeaderPin(Policy[HeaderPinParams]):
    def __init__(self, params: HeaderPinParams) -> None:
        super().__init__(params)
        self.load = LoadScorer()

    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        ranked = rank_by(request, candidates, [(1.0, self.load)])
        wanted = request.headers.get(self.params.header)
        pinned = [c for c in ranked if c.replica.name == wanted]
        return pinned + [c for c in ranked if c.replica.name != wanted]

    def on_complete(self, request: RequestFeatures, replica: ReplicaView | None, outcome: Outcome) -> None:
        wanted = request.headers.get(self.params.header)
        if wanted is not None:
            log.info(
                "request %s pinned to %s ended on %s: ok=%s status=%s error=%s ttft=%s e2e=%.3fs",
                request.request_id,
                wanted,
                replica.name if replica is not None else None,
                outcome.ok,
                outcome.status,
                outcome.error,
                outcome.ttft_s,
                outcome.e2e_s,
            )
