"""least_load: the replica with the least work queued, by the engine's figures and our own."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import Candidate, Policy, RequestFeatures


class LeastLoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    waiting_token_cost: int = Field(
        1024, ge=0, description="Tokens of work assumed per request the engine reports waiting or running"
    )


class LeastLoad(Policy):
    Params = LeastLoadParams

    def __init__(self, params: BaseModel) -> None:
        super().__init__(params)
        self._turn = 0

    async def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        cost = self.params.waiting_token_cost  # type: ignore[attr-defined]
        n = len(candidates)
        self._turn += 1
        turn = self._turn

        def load(item: tuple[int, Candidate]) -> tuple[int, int, int]:
            i, c = item
            r = c.replica
            # Our own in-flight tokens are exact and current (the lease is taken at decision time),
            # other gateways' (shared state) a sync interval old; the engine's figures count
            # everyone's, but only while its scrape is fresh. They overlap (the gateways' requests
            # are in the engine's too), so the larger one counts, not the sum.
            tokens = r.inflight_tokens + r.remote_inflight_tokens
            if r.engine_fresh:
                tokens = max(tokens, (r.engine.waiting + r.engine.running) * cost)
            # Equal loads (an idle fleet) rotate, instead of always falling to the first replica.
            return (tokens, r.inflight_requests + r.remote_inflight_requests, (i - turn) % n)

        return [c for _, c in sorted(enumerate(candidates), key=load)]
