"""The routing-policy plugin API, as plugins import it: `from gateway.policy import Policy, ...`.

The implementation lives in `gateway.routing.policy`; this module is the stable public path.
"""

from gateway.routing.policy import Candidate, NoParams, Policy, ReplicaView, RequestFeatures

__all__ = ["Candidate", "NoParams", "Policy", "ReplicaView", "RequestFeatures"]
