"""The routing-policy plugin API, as plugins import it: `from gateway.policy import Policy, ...`.

The implementation lives in `gateway.routing.policy`; this module is the stable public path.
`API_VERSION` says which version of the API it is.
"""

from gateway.routing.policy import (
    API_VERSION,
    Candidate,
    LoadScorer,
    NoParams,
    Outcome,
    Pair,
    Policy,
    PrefixScorer,
    ReplicaView,
    RequestFeatures,
    Scorer,
    least_loaded,
    per_device,
    rank_by,
    relative_prefill_speeds,
    uncached_tokens,
)

__all__ = [
    "API_VERSION",
    "Candidate",
    "LoadScorer",
    "NoParams",
    "Outcome",
    "Pair",
    "Policy",
    "PrefixScorer",
    "ReplicaView",
    "RequestFeatures",
    "Scorer",
    "least_loaded",
    "per_device",
    "rank_by",
    "relative_prefill_speeds",
    "uncached_tokens",
]
