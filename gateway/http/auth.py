"""Bearer-key checks: client keys (each may name a tenant) and the separate admin key."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping

from gateway.config import Settings
from gateway.errors import GatewayError


def _bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _find(token: str, keys: list[tuple[bytes, str | None]]) -> tuple[bool, str | None]:
    """Compare against every key in constant time each, without stopping at a match,
    so the time taken says nothing about which key (or how much of one) matched."""
    found, tenant = False, None
    given = token.encode()
    for key, name in keys:
        if hmac.compare_digest(given, key):
            found, tenant = True, name
    return found, tenant


class Auth:
    def __init__(self, settings: Settings) -> None:
        keys: list[tuple[bytes, str | None]] = [(k.encode(), None) for k in settings.server.api_keys]
        keys += [(t.api_key.encode(), t.name) for t in settings.tenants]
        self._client_keys = keys
        admin_key = settings.control.admin_key
        self._admin_key = admin_key.encode() if admin_key else None

    def client(self, request: object) -> str | None:
        """The tenant name of the request (None when anonymous or an untenanted key)."""
        headers: Mapping[str, str] = request.headers  # type: ignore[attr-defined]
        if not self._client_keys:
            return None
        token = _bearer(headers)
        if token is None:
            raise GatewayError(
                401,
                "missing bearer API key (Authorization: Bearer ...)",
                "authentication_error",
                "missing_api_key",
            )
        ok, tenant = _find(token, self._client_keys)
        if not ok:
            raise GatewayError(401, "invalid API key", "authentication_error", "invalid_api_key")
        return tenant

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
