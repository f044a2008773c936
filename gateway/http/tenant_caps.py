"""Per-tenant cap on requests being received or prepared at once, so that one key cannot hold
every connection slot with bodies trickled a byte at a time (each such connection is busy, and
busy connections are never evicted to make room).

A request counts from its authenticated head until its answer starts (its body read, its queueing
and dispatch); past the cap it is a 429 `too_many_concurrent_requests` with Retry-After, answered
before its body is read, after which the connection closes (the servers drop an unread body for a
few seconds at most, then close), so surplus connections do not stay busy.
`tenants[].max_concurrent_requests`, else `server.max_requests_per_tenant`; requests without a
tenant (no keys, or an untenanted key) are bounded by the connection cap only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.admission.limits import ShedError
from gateway.config import Settings


class TenantCaps:
    def __init__(self, settings: Settings) -> None:
        default = settings.server.max_requests_per_tenant
        self._caps = {t.name: t.max_concurrent_requests or default for t in settings.tenants}
        self._open: dict[str, int] = {}

    @contextmanager
    def hold(self, tenant: str | None) -> Iterator[None]:
        cap = self._caps.get(tenant) if tenant is not None else None
        if cap is None:
            yield
            return
        assert tenant is not None
        count = self._open.get(tenant, 0)
        if count >= cap:
            raise ShedError(
                429,
                f"too many requests of this key at once (at most {cap} being sent or prepared)",
                "too_many_concurrent_requests",
                1,
            )
        self._open[tenant] = count + 1
        try:
            yield
        finally:
            left = self._open[tenant] - 1
            if left:
                self._open[tenant] = left
            else:
                del self._open[tenant]
