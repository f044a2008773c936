"""What every route's answer goes through, on either HTTP server: errors in the OpenAI form,
never a traceback."""

from __future__ import annotations

import logging

from gateway.admission.limits import ShedError
from gateway.errors import GatewayError, error_body
from gateway.logs import clip
from gateway.path.exchange import Exchange, Reply
from gateway.path.request_record import RequestRecord
from gateway.path.sanitize import client_request_id, new_request_id

log = logging.getLogger(__name__)

_JSON = "application/json"


def gateway_error_reply(exc: GatewayError, headers: dict[str, str] | None = None) -> Reply:
    return Reply(exc.status, exc.body(), {"Content-Type": _JSON, **(headers or {}), **exc.headers})


def new_record(ex: Exchange, endpoint: str, inference: bool = True) -> RequestRecord:
    """A recorded request's record. Engines get an id the gateway makes; the client's own id, when
    usable, names the request in logs and in the answer's X-Request-Id."""
    engine_id = new_request_id()
    client_id = client_request_id(ex.headers.get("x-request-id"))
    return RequestRecord(client_id or engine_id, endpoint, engine_request_id=engine_id, inference=inference)


def error_response(exc: GatewayError, rec: RequestRecord) -> Reply:
    """A recorded request's error, in the OpenAI form, written into its record for the observers."""
    rec.status = exc.status
    rec.error_code = exc.code
    if isinstance(exc, ShedError):
        rec.shed_reason = exc.shed_reason
    return gateway_error_reply(exc, {"x-request-id": rec.request_id})


def failure_reply(exc: Exception, ex: Exchange) -> Reply:
    """A handler's exception as its answer: the OpenAI error form, never a traceback. Each server
    awaits its handler in `try: ... except Exception as exc: failure_reply(exc, ex)` (one coroutine
    fewer per request than a wrapper around it)."""
    if isinstance(exc, GatewayError):
        return gateway_error_reply(exc)
    log.error("unhandled error on %s %s", ex.method, clip(ex.path), exc_info=exc)
    return Reply(
        500,
        error_body("internal gateway error", "server_error", "internal_error"),
        {"Content-Type": _JSON},
    )


def route_error(status: int, reason: str, method: str, path: str) -> Reply:
    """No route for the path (404) or for the method (405), or another HTTP-level refusal."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    body = error_body(f"{method} {clip(path)}: {reason}", "invalid_request_error", code)
    return Reply(status, body, {"Content-Type": _JSON})


def unsupported_coding(transfer_encoding: str) -> bool:
    """A Transfer-Encoding that ends in chunked with another coding before it (`gzip, chunked`):
    one the body would need undone and nothing here undoes (RFC 9112 6.1: 501). One that does not
    end in chunked is the parsers' to refuse (400: the body's length is unknown)."""
    codings = [c.strip().lower() for c in transfer_encoding.split(",")]
    return len(codings) > 1 and codings[-1] == "chunked"
