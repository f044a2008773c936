"""least_load: the replica with the least work queued, by the engine's figures and our own."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import Candidate, Policy, RequestFeatures


class LeastLoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    waiting_token_cost: int = Field(
        1024, ge=0, description="Tokens of work assumed per request waiting in the engine's own queue"
    )


class LeastLoad(Policy):
    Params = LeastLoadParams

    async def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        cost = self.params.waiting_token_cost  # type: ignore[attr-defined]

        def load(c: Candidate) -> tuple[float, int]:
            r = c.replica
            # Our own in-flight tokens are exact and current; the engine's waiting queue also
            # counts other gateways' requests, but only while its scrape is fresh.
            engine_waiting = r.engine.waiting if r.engine_fresh else 0
            return (r.inflight_tokens + engine_waiting * cost, r.inflight_requests)

        return sorted(candidates, key=load)
