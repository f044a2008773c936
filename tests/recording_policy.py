"""A routing policy for tests, loaded by "tests.recording_policy:Recording" like any plugin: it
ranks replicas by name (a request's `x-pin` header puts one first), can put a named prefill
replica first in a pair, and records every `on_routed`, `on_first_token` and `on_complete` call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from gateway.policy import Candidate, Outcome, Pair, Policy, ReplicaView, RequestFeatures

ID_HEADER = "x-test-id"  # names a request in what the policy records


class RecordingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill_first: str | None = None  # the prefill replica `select_pair` puts first


@dataclass(frozen=True)
class Ended:
    test_id: str | None
    replica: str | None
    outcome: Outcome


class Recording(Policy[RecordingParams]):
    def __init__(self, params: RecordingParams) -> None:
        super().__init__(params)
        self.ended: list[Ended] = []
        self.first_tokens: list[tuple[str | None, str, bool]] = []  # (test id, replica, ended already)
        self.routed: list[tuple[str | None, str]] = []  # (test id, replica)
        self.pairs = 0

    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        pin = request.headers.get("x-pin")
        return sorted(candidates, key=lambda c: (c.replica.name != pin, c.replica.name))

    def select_pair(
        self, request: RequestFeatures, prefill: Sequence[Candidate], decode: Sequence[Candidate]
    ) -> Pair:
        self.pairs += 1
        first = self.params.prefill_first
        return Pair(sorted(prefill, key=lambda c: c.replica.name != first), self.rank(request, decode))

    def on_routed(self, request: RequestFeatures, replica: ReplicaView) -> None:
        self.routed.append((request.headers.get(ID_HEADER), replica.name))

    def on_first_token(self, request: RequestFeatures, replica: ReplicaView) -> None:
        test_id = request.headers.get(ID_HEADER)
        self.first_tokens.append((test_id, replica.name, bool(self.of(test_id))))

    def on_complete(self, request: RequestFeatures, replica: ReplicaView | None, outcome: Outcome) -> None:
        name = replica.name if replica is not None else None
        self.ended.append(Ended(request.headers.get(ID_HEADER), name, outcome))

    def of(self, test_id: str) -> list[Ended]:
        return [e for e in self.ended if e.test_id == test_id]
