"""Discovery: replicas that join and leave a pool as an outside system (Kubernetes) says.

A source computes the endpoints that should serve a pool and hands them to a `Reconciler`, which
changes the pool only through `Membership` (add, drain, remove).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.discovery.membership import Endpoint, Membership, Reconciler, RuntimeMembership

if TYPE_CHECKING:
    from gateway.discovery.kubernetes import KubernetesDiscovery
    from gateway.pool import Pool
    from gateway.runtime import Runtime


def make_discovery(runtime: Runtime, pool: Pool) -> KubernetesDiscovery | None:
    """The pool's discovery source, if its config has one (not started)."""
    if pool.cfg.discovery is None:
        return None
    from gateway.discovery.kubernetes import KubernetesDiscovery

    return KubernetesDiscovery(pool.cfg.discovery.kubernetes, RuntimeMembership(runtime, pool))


__all__ = ["Endpoint", "Membership", "Reconciler", "RuntimeMembership", "make_discovery"]
