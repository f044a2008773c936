"""Bearer-key checks: client keys (each may name a tenant) and the separate admin key."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import NamedTuple

from gateway.config import Settings
from gateway.errors import GatewayError


def _bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Caller(NamedTuple):
    """Who sent a request, as far as its key says."""

    tenant: str | None  # the tenant its key names; None: no keys configured, or a plain key
    # What the per-key cap counts it under: the tenant's name, a plain key's place in
    # `server.api_keys` (never the key itself), None when no keys are configured.
    holder: str | int | None


ANONYMOUS = Caller(None, None)


def _find(token: str, keys: list[tuple[bytes, str | int]]) -> str | int | None:
    """The holder of the key that matches: compared against every key in constant time each,
    without stopping at a match, so the time taken says nothing about which key (or how much of
    one) matched."""
    found: str | int | None = None
    given = token.encode()
    for key, holder in keys:
        if hmac.compare_digest(given, key):
            found = holder
    return found


class Auth:
    def __init__(self, settings: Settings) -> None:
        plain = enumerate(settings.server.api_keys)
        keys: list[tuple[bytes, str | int]] = [(k.encode(), i) for i, k in plain]
        keys += [(t.api_key.encode(), t.name) for t in settings.tenants]
        self._client_keys = keys
        admin_key = settings.control.admin_key
        self._admin_key = admin_key.encode() if admin_key else None

    def client(self, request: object) -> Caller:
        """Who sent the request (ANONYMOUS when no keys are configured); 401 without a valid key."""
        headers: Mapping[str, str] = request.headers  # type: ignore[attr-defined]
        if not self._client_keys:
            return ANONYMOUS
        token = _bearer(headers)
        if token is None:
            raise GatewayError(
                401,
                "missing bearer API key (Authorization: Bearer ...)",
                "authentication_error",
                "missing_api_key",
            )
        holder = _find(token, self._client_keys)
        if holder is None:
            raise GatewayError(401, "invalid API key", "authentication_error", "invalid_api_key")
        return Caller(holder if isinstance(holder, str) else None, holder)

    @property
    def admin(self) -> Callable[[Mapping[str, str]], None] | None:
        """The admin key check (the control plane's routes, the status page's data); None when no
        admin key is set: then there is no control plane and the status page is open."""
        key = self._admin_key
        if key is None:
            return None

        def check(headers: Mapping[str, str]) -> None:
            token = _bearer(headers)
            if token is None or not hmac.compare_digest(token.encode(), key):
                raise GatewayError(
                    401, "invalid or missing admin key", "authentication_error", "invalid_admin_key"
                )

        return check
