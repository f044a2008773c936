"""Per-key cap on requests being received or prepared at once, so that one key cannot hold every
connection slot with bodies trickled a byte at a time (each such connection is busy, and busy
connections are never evicted to make room).

A request counts from its authenticated head until its answer starts (its body read, its queueing
and dispatch); past the cap it is a 429 `too_many_concurrent_requests` with Retry-After, answered
before its body is read, after which the connection closes (the servers drop an unread body for a
few seconds at most, then close), so surplus connections do not stay busy. A tenant's key counts
under the tenant, with `tenants[].max_concurrent_requests`, else `server.max_requests_per_tenant`;
each plain key of `server.api_keys` counts on its own, with `server.max_requests_per_tenant`.
Without keys configured there is no key to tell clients apart by: the connection cap bounds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.admission.limits import ShedError
from gateway.config import Settings


class TenantCaps:
    def __init__(self, settings: Settings) -> None:
        self._default = settings.server.max_requests_per_tenant
        self._caps = {t.name: t.max_concurrent_requests or self._default for t in settings.tenants}
        self._open: dict[str | int, int] = {}

    @contextmanager
    def hold(self, holder: str | int | None) -> Iterator[None]:
        """Count a request of `holder` (a tenant's name, a plain key's index: `Caller.holder`)."""
        if holder is None:
            yield
            return
        cap = self._caps[holder] if isinstance(holder, str) else self._default
        count = self._open.get(holder, 0)
        if count >= cap:
            raise ShedError(
                429,
                f"too many requests of this key at once (at most {cap} being sent or prepared)",
                "too_many_concurrent_requests",
                1,
            )
        self._open[holder] = count + 1
        try:
            yield
        finally:
            left = self._open[holder] - 1
            if left:
                self._open[holder] = left
            else:
                del self._open[holder]
