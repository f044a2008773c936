"""What of a client's request may reach an engine.

Engines trust their callers: a body field or header can point a decode engine at another host for
its KV transfer, pin a data-parallel rank, reuse another request's engine id, make the engine run
code, or inject faults. Each engine adapter names what steers its kind (`control_fields`,
`control_headers`, `control_header_prefixes` in gateway/fleet/engines/); the gateway is the caller
engines trust, so a client's copy of any of them is removed before the request is routed, whatever
engine serves it, and the gateway's own values (PD hand-off, request id, priority) are the only
ones an engine sees.
A pool may let named fields or headers through (`client_passthrough`), for engines that are meant
to take them from clients.

Headers never forwarded whatever the pool says: hop-by-hop headers (RFC 9110 section 7.6.1) and
every header the client's `Connection` header names, framing the proxy redoes, and the gateway's
own credentials.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.fleet.engines import CONTROL_FIELDS, CONTROL_HEADER_PREFIXES, CONTROL_HEADERS

# Hop-by-hop (RFC 9110 7.6.1, plus the de facto Keep-Alive and Proxy-Connection), framing the
# proxy redoes, the gateway's own credentials, content coding the gateway has already undone, and
# the request id, which is always the gateway's (it keys the engine's request and the gateway's own
# bookkeeping, so a client must not be able to make two requests share one).
NEVER_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "host",
        "content-length",
        "content-encoding",
        "content-type",
        "expect",
        "accept-encoding",
        "authorization",
        "cookie",
        "x-request-id",
    }
)
# A client's request id is kept for logs and echoed back only when it is short visible ASCII.
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")
# Header values: visible ASCII, space and tab. Anything else (obs-text such as UTF-8, controls)
# is refused rather than passed on: engines would read it as Latin-1, and no OpenAI client sends it.
_BAD_VALUE = re.compile(r"[^\t\x20-\x7e]")


def invalid_header(headers: Mapping[str, str]) -> str | None:
    """The name of the first header whose value holds anything but visible ASCII, space and tab."""
    joined = "".join(headers.values())
    if (joined.isascii() and joined.isprintable()) or _BAD_VALUE.search(joined) is None:
        return None  # the first test is the fast path; tabs fail it and take the second
    return next(k for k, v in headers.items() if _BAD_VALUE.search(v))


_IDS_PER_READ = 256
_ids: list[str] = []


def _forget_ids() -> None:
    _ids.clear()  # a forked child must not hand out its parent's ids


os.register_at_fork(after_in_child=_forget_ids)


def new_request_id() -> str:
    """128 random bits from the OS, as hex. Read 256 ids at a time: one getrandom call per
    request was 1.4% of the gateway's CPU per request."""
    if not _ids:
        pool = os.urandom(16 * _IDS_PER_READ).hex()
        _ids.extend(pool[i : i + 32] for i in range(0, len(pool), 32))
    return _ids.pop()


def client_request_id(value: str | None) -> str | None:
    """The client's `X-Request-Id` if it is safe to log and echo (visible ASCII, at most 128)."""
    if value and _CLIENT_ID.fullmatch(value):
        return value
    return None


def strip_body(body: dict[str, Any], allowed: frozenset[str]) -> list[str]:
    """Remove the engine-steering fields a client sent (except those `allowed`); their names."""
    if CONTROL_FIELDS.isdisjoint(body):
        return []
    removed = [k for k in CONTROL_FIELDS.intersection(body) if k not in allowed]
    for key in removed:
        del body[key]
    return sorted(removed)


def _connection_tokens(values: Iterable[str]) -> set[str]:
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


# A header name's lower-case form and what it is (_FORWARD, _NEVER, _ENGINE), by the name as sent:
# clients send the same few names on every request, so each is classified once.
_FORWARD, _NEVER, _ENGINE = 0, 1, 2
_KINDS: dict[str, tuple[str, int]] = {}
_KINDS_MAX = 4096  # clients choose names: bounded


def _kind(key: str) -> tuple[str, int]:
    name = key.lower()
    if name in NEVER_FORWARDED:
        kind = _NEVER
    elif name in CONTROL_HEADERS or name.startswith(CONTROL_HEADER_PREFIXES):
        kind = _ENGINE
    else:
        kind = _FORWARD
    if len(_KINDS) < _KINDS_MAX:
        _KINDS[key] = (name, kind)
    return name, kind


def upstream_headers(
    items: Iterable[tuple[str, str]], allowed: frozenset[str], request_id: str
) -> dict[str, str]:
    """The headers an engine gets: the client's, less what must not pass, plus the gateway's id.

    `items` are the client's headers in order (repeats included); `allowed` are lower-case names a
    pool lets through although engines act on them."""
    headers: dict[str, str] = {}
    connection: list[str] | None = None
    kinds = _KINDS
    for key, value in items:
        name, kind = kinds.get(key) or _kind(key)
        if kind == _FORWARD or (kind == _ENGINE and name in allowed):
            headers[key] = value
        elif name == "connection":
            connection = [value] if connection is None else [*connection, value]
    if connection is not None:
        # The names a Connection header lists are hop-by-hop too, wherever they came in the order.
        named = _connection_tokens(connection) - NEVER_FORWARDED
        if named:
            headers = {k: v for k, v in headers.items() if k.lower() not in named}
    headers["X-Request-Id"] = request_id
    headers["Content-Type"] = "application/json"
    return headers
