"""least_load: the replica with the least work queued, by the engine's figures and our own."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy import Candidate, LoadScorer, Policy, RequestFeatures, least_loaded


class LeastLoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    waiting_token_cost: int = Field(
        1024, ge=0, description="Tokens of work assumed per request the engine reports waiting or running"
    )


class LeastLoad(Policy[LeastLoadParams]):
    def __init__(self, params: LeastLoadParams) -> None:
        super().__init__(params)
        self._load = LoadScorer(params.waiting_token_cost)
        self._turn = 0

    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        self._turn += 1
        return least_loaded(candidates, self._load, self._turn)
