"""The access log: one line per request on logger `kvgate.access`, built from its RequestRecord.

It carries ids, routing and timings, never prompt or completion text (the record holds none)
nor keys. With `server.log_json` each line is a JSON object whose fields are top-level keys.
"""

from __future__ import annotations

import logging

from gateway.path.request_record import RequestRecord

log = logging.getLogger("kvgate.access")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def access_fields(rec: RequestRecord) -> dict[str, object]:
    fields: dict[str, object] = {
        "request_id": rec.request_id,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "pool": rec.pool,
        "replica": rec.replica,
        "status": rec.status,
        "stream": rec.stream,
        "priority": rec.priority_class,
        "tenant": rec.tenant,
        "prompt_tokens": rec.prompt_tokens,
        "matched_tokens": rec.matched_tokens,
        "route_reason": rec.route_reason,
        "retries": rec.retries,
        "queue_ms": _ms(rec.queued_s),
        # Arrival to the (last) attempt's send: the gateway's own share of ttft_ms, queue included.
        "sent_ms": None if rec.sent_at is None else _ms(rec.sent_at - rec.started),
        "ttft_ms": _ms(rec.ttft_s),
        "total_ms": _ms(rec.duration_s),
    }
    # Only present when they say something, to keep the common line short.
    if rec.engine_request_id and rec.engine_request_id != rec.request_id:
        fields["engine_request_id"] = rec.engine_request_id
    if rec.cpu_matched_tokens:  # believed held in the replica's CPU tier, after its GPU match
        fields["cpu_matched_tokens"] = rec.cpu_matched_tokens
    if rec.engine_cached_tokens is not None:  # the engine's usage: prompt tokens its prefix cache served
        fields["cached_tokens"] = rec.engine_cached_tokens
    if rec.error_code:
        fields["error"] = rec.error_code
    if rec.shed_reason:
        fields["shed"] = rec.shed_reason
    if rec.resent:  # sent again on a fresh connection by the transport: the engine may have run it twice
        fields["resent"] = rec.resent
    if rec.resumed:  # continued after each "<reason>@<replica>" broke, on `replica` at the end
        fields["resumed"] = rec.resumed
    if rec.client_disconnected:
        fields["client_disconnected"] = True
    return fields


def access_log(rec: RequestRecord) -> None:
    """The observer registered in `runtime.observers` when `server.access_log` is on."""
    if log.isEnabledFor(logging.INFO):
        log.info("request", extra={"fields": access_fields(rec)})
