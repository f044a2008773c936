"""round_robin: each request to the next available replica in turn; the baseline."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policy import Candidate, NoParams, Policy, RequestFeatures


class RoundRobin(Policy[NoParams]):
    def __init__(self, params: NoParams) -> None:
        super().__init__(params)
        self._next = 0

    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        n = len(candidates)
        if n == 0:
            return []
        start = self._next % n
        self._next += 1
        # Rotate, so retries walk on to the following replicas.
        return [*candidates[start:], *candidates[:start]]
