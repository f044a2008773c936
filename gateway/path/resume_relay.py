"""The relay of one attempt at a continuable answer (gateway/path/resume.py holds the answer's
state): its events go to the client through `Resume.feed` (or are assembled, for a client that
asked no stream), and a failure after the answer began raises `Cut`, for the proxy to send the
continuation to another replica, while the answer can be continued."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import orjson

from gateway.errors import GatewayError
from gateway.fleet.replica import Replica
from gateway.path.claim import Claim
from gateway.path.exchange import Exchange, Reply, StreamOut
from gateway.path.model_names import ModelRename
from gateway.path.pd import PREFILL_LOST, PrefillWatch
from gateway.path.request_record import USAGE_MARK, RequestRecord, read_usage
from gateway.path.resume import Resume
from gateway.path.sse_events import EventStream, sse_error_event
from gateway.path.stream_end import StreamEnd, client_left
from gateway.path.transports.base import Response
from gateway.path.upstream import Upstream, UpstreamError

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"


# Cuts of a hand-off's decode leg before its answer began: the KV did not arrive, the decode
# replica is not at fault, and the request goes again whole, without a hand-off.
HANDOFF_FAILURES = frozenset({"prefill_lost", "kv_load_failed"})


class Cut(Exception):
    """An answer's attempt failed after it began, and the answer can be continued elsewhere."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def relay_resumable(
    upstream: Upstream,
    request: Exchange,
    resp: Response,
    headers: dict[str, str],
    claim: Claim,
    rec: RequestRecord,
    rename: ModelRename | None,
    first: Callable[[], None] | None,
    resume: Resume,
    kv_from: Replica | None = None,
) -> Reply | StreamOut:
    """An attempt's stream, relayed (or assembled, for a non-streamed client) through `resume`:
    a failure after the answer began raises `Cut` while the answer can be continued. `kv_from`,
    the prefill replica a hand-off's decode leg takes its KV from: should it be ejected before
    the first byte, the attempt is cut (`prefill_lost`)."""
    events = EventStream(rename)
    end = StreamEnd(rec.endpoint)
    failure: str | None = None
    finished = False
    ejected: list[str] = []
    text_before = len(resume.sent_text()) if kv_from is not None else 0

    def eject() -> None:  # the replica's health checks failed: stop waiting for its bytes
        ejected.append("ejected")
        resp.close()

    replica = claim.replica
    replica.on_eject.add(eject)
    watch = PrefillWatch(kv_from, resp, ejected)
    try:
        if resume.out is None and not resume.buffered:
            resume.out = await request.stream(resp.status, headers)
        out = resume.out
        try:
            async for chunk in upstream.chunks(resp):
                watch.heard = True
                if rec.first_byte_at is None:
                    rec.first_byte_at = time.perf_counter()
                    if first is not None:
                        first()
                chunk = resume.feed(events.feed(chunk))
                if chunk:  # only ever for a client that streams
                    assert out is not None
                    if USAGE_MARK in chunk:
                        read_usage(chunk, rec)
                    await out.write(chunk)
                    end.feed(chunk)
                if resume.failure is not None:
                    break
            else:
                tail = resume.feed(events.flush())
                if tail:
                    assert out is not None
                    await out.write(tail)
                    end.feed(tail)
            failure = resume.failure or (None if resume.done else "closed_early")
            if failure == "engine_error" and kv_from is not None and len(resume.sent_text()) == text_before:
                # An error before any text of a decode leg that was to load its prompt's KV:
                # vLLM's `kv_load_failure_policy: fail`. The decode replica can serve it whole.
                failure = "kv_load_failed"
            if failure in ("malformed_event", "closed_early"):
                what = "a malformed event" if failure == "malformed_event" else "no end to its stream"
                resume.error_event = sse_error_event(f"engine sent {what}", "upstream_stream_error")
        except UpstreamError as exc:
            if exc.replica_fault:
                claim.failed()
            log.warning("request %s: stream from upstream failed: %s", rec.request_id, exc)
            timed_out = exc.code == "upstream_timeout"
            failure = ejected[0] if ejected else "idle_timeout" if timed_out else "disconnected"
            message = PREFILL_LOST if failure == "prefill_lost" else str(exc)
            resume.error_event = sse_error_event(message, "upstream_stream_error")
        if failure is not None and resume.whole:
            # Only the stream's end was lost ([DONE], or the connection's close after it): the
            # client has the whole answer, and gets the end it expects.
            failure = None
            if not resume.done and out is not None:
                await out.write(_DONE)
                end.feed(_DONE)
        if failure is not None and resume.continuable:
            raise Cut(failure)
        if resume.buffered:
            if failure == "too_large":
                raise GatewayError(
                    502,
                    f"engine response exceeds {resume.max_kept} bytes",
                    "upstream_error",
                    "upstream_response_too_large",
                )
            if failure is not None:
                raise GatewayError(
                    502, f"engine answer broke: {failure}", "upstream_error", "upstream_stream_error"
                )
            rec.completed = finished = True
            read_usage(orjson.dumps({"usage": resume.usage}), rec)
            body = resume.assembled()  # of events already renamed
            headers["Content-Type"] = "application/json"
            return Reply(resp.status, body, headers)
        assert out is not None
        if failure is not None:
            rec.error_code = "upstream_stream_error"
            await out.write(resume.error_event or sse_error_event(failure, "upstream_stream_error"))
        await out.write_eof()
        finished = True
    except ConnectionResetError:
        client_left(end, rec)
    finally:
        rec.resume_blocked = resume.blocked
        replica.on_eject.discard(eject)
        watch.close()
        if finished:
            resp.release()
        else:
            rec.completed = rec.completed or end.complete
            resp.close()
    return resume.out if resume.out is not None else Reply(499)
