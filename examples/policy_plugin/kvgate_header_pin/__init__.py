"""header_pin: an example kvgate routing-policy plugin.

A request whose header (default `x-pin-replica`) names a replica goes there first (e.g. to
reproduce a problem on one engine); every other request, and the fallbacks of a pinned one,
go to the replicas with the fewest requests in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import Candidate, Policy, RequestFeatures


class HeaderPinParams(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt argument is an error at startup
    header: str = Field("x-pin-replica", min_length=1, description="Request header naming the replica")


class HeaderPin(Policy):
    Params = HeaderPinParams

    async def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        ranked = sorted(candidates, key=lambda c: c.replica.inflight_requests)
        wanted = request.headers.get(self.params.header)  # type: ignore[attr-defined]
        pinned = [c for c in ranked if c.replica.name == wanted]
        return pinned + [c for c in ranked if c.replica.name != wanted]
