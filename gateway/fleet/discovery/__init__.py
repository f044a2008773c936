"""Discovery: replicas that join and leave a pool as an outside system (Kubernetes) says.

A source computes the endpoints that should serve a pool and hands them to a `Reconciler`, which
changes the pool only through `Membership` (add, drain, remove).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.fleet.discovery.membership import Endpoint, Membership, PoolMembership, Reconciler, Registry

if TYPE_CHECKING:
    from gateway.fleet.discovery.kubernetes import KubernetesDiscovery
    from gateway.fleet.pool import Pool


def make_discovery(registry: Registry, pool: Pool) -> KubernetesDiscovery | None:
    """The pool's discovery source, if its config has one (not started)."""
    if pool.cfg.discovery is None:
        return None
    from gateway.fleet.discovery.kubernetes import KubernetesDiscovery

    return KubernetesDiscovery(pool.cfg.discovery.kubernetes, PoolMembership(registry, pool))


__all__ = ["Endpoint", "Membership", "PoolMembership", "Reconciler", "Registry", "make_discovery"]
