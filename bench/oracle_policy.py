"""OraclePolicy: the benchmark's reference router, pinning each prompt group to one replica.

The bench client tags every request with its group (header `x-kvgate-group`, e.g. "g12"). Group g
goes to replica g mod N over the replicas sorted by name, so groups spread evenly and each stays
warm on one replica: the best hit rate a router can reach on shared-prefix workloads, known only
to the benchmark. Load it by path, "bench.oracle_policy:OraclePolicy"; never use it in production.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import xxhash

from gateway.policy import Candidate, NoParams, Policy, RequestFeatures

GROUP_HEADER = "x-kvgate-group"
_DIGITS = re.compile(r"(\d+)$")


def group_number(group: str) -> int:
    """The trailing number of a group id; a stable hash when it has none."""
    m = _DIGITS.search(group)
    return int(m.group(1)) if m else xxhash.xxh64_intdigest(group.encode())


class OraclePolicy(Policy[NoParams]):
    def rank(self, request: RequestFeatures, candidates: Sequence[Candidate]) -> list[Candidate]:
        ordered = sorted(candidates, key=lambda c: c.replica.name)
        group = request.headers.get(GROUP_HEADER)
        if not ordered or group is None:
            return sorted(ordered, key=lambda c: c.replica.inflight_requests)
        start = group_number(group) % len(ordered)
        return [*ordered[start:], *ordered[:start]]
