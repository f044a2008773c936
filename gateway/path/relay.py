"""The relay of one attempt's answer to the client: an error rewritten in the OpenAI form, a body
read whole, or a stream of events, byte for byte but for the model's name.

One stream relay serves both kinds of answer. A plain one goes out as it comes; should the engine
fail mid-stream, the client is told with an error event, never truncated silently. One that
failover follows (a `Resume`) goes through it: its events are relayed (or assembled, for a client
that asked no stream) and a failure after the answer began raises `Cut` while the answer can be
continued, for the attempts to send the continuation to another replica. A followed answer is also
cut when health checks eject its replica, and a hand-off's decode leg when its prefill replica is
ejected before the first byte (`prefill_lost`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import orjson

from gateway.errors import GatewayError, normalize_error_body
from gateway.fleet.replica import Replica
from gateway.path.claim import Claim
from gateway.path.exchange import Exchange, Reply, StreamOut
from gateway.path.handoff import PREFILL_LOST, PrefillWatch
from gateway.path.model_names import ModelRename
from gateway.path.request_record import USAGE_MARK, RequestRecord, read_usage
from gateway.path.resume import Resume
from gateway.path.sse_events import EventStream, sse_error_event
from gateway.path.stream_end import StreamEnd, client_left
from gateway.path.transports.base import Response
from gateway.path.upstream import ERROR_BODY_LIMIT, Upstream, UpstreamError

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"
# Not relayed to the client: hop-by-hop, framing the proxy redoes, and the gateway's own headers.
_DROP_RESPONSE = frozenset(
    {
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "server",
        "date",
        "x-request-id",
        "x-kvgate-replica",
        "x-kvgate-pool",
    }
)
# An engine's Content-Encoding is relayed with its body untouched, except where the gateway
# rewrites the body (errors, normalized after decoding).
_DROP_REWRITTEN = _DROP_RESPONSE | {"content-encoding"}
# Cuts of a hand-off's decode leg before its answer began: the KV did not arrive, the decode
# replica is not at fault, and the request goes again whole, without a hand-off.
HANDOFF_FAILURES = frozenset({"prefill_lost", "kv_load_failed"})


class Cut(Exception):
    """An answer's attempt failed after it began, and the answer can be continued elsewhere."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def response_headers(
    resp: Response, replica: Replica, request_id: str, drop: frozenset[str] = _DROP_RESPONSE
) -> dict[str, str]:
    headers = {k: v for k, v in resp.headers if k.lower() not in drop}
    headers["x-request-id"] = request_id
    headers["x-kvgate-replica"] = replica.name
    headers["x-kvgate-pool"] = replica.pool
    return headers


async def read_error(upstream: Upstream, resp: Response) -> bytes:
    """An engine's error body, bounded (b"" if it cannot be read); the answer is released."""
    try:
        return await upstream.read_content(resp, ERROR_BODY_LIMIT)
    except UpstreamError:
        return b""
    finally:
        resp.release()


async def relay(
    upstream: Upstream,
    request: Exchange,
    resp: Response,
    claim: Claim,
    rec: RequestRecord,
    rename: ModelRename | None,
    first: Callable[[], None] | None,
    resume: Resume | None,
    kv_from: Replica | None,
) -> Reply | StreamOut:
    """Relay the engine's answer; `first` is called once at a streamed answer's first bytes;
    `resume`, when the answer may be continued elsewhere, follows it (raising `Cut`); `kv_from`, a
    hand-off's prefill replica, ends the wait for the first byte if ejected."""
    rec.status = resp.status
    if resp.status >= 400:
        # Rewritten in the OpenAI form, decoded: the engine's Content-Encoding no longer applies.
        headers = response_headers(resp, claim.replica, rec.request_id, _DROP_REWRITTEN)
        raw = await read_error(upstream, resp)
        headers["Content-Type"] = "application/json"
        return Reply(resp.status, normalize_error_body(raw, resp.status), headers)
    headers = response_headers(resp, claim.replica, rec.request_id)
    if not resp.content_type.startswith("text/event-stream"):
        try:
            raw = await upstream.read(resp)
        except UpstreamError as exc:
            if exc.replica_fault:
                claim.failed()
            raise exc.gateway_error(claim.replica.name) from None
        finally:
            resp.release()
        rec.first_byte_at = time.perf_counter()
        read_usage(raw, rec)
        if rename is not None and not resp.header("Content-Encoding"):
            raw = rename.apply(raw)
        return Reply(resp.status, raw, headers)
    return await StreamRelay(
        upstream, request, resp, headers, claim, rec, rename, first, resume, kv_from
    ).run()


class StreamRelay:
    """One attempt's stream, relayed; followed by `resume` when the answer may be continued."""

    def __init__(
        self,
        upstream: Upstream,
        request: Exchange,
        resp: Response,
        headers: dict[str, str],
        claim: Claim,
        rec: RequestRecord,
        rename: ModelRename | None,
        first: Callable[[], None] | None,
        resume: Resume | None,
        kv_from: Replica | None,
    ) -> None:
        self.upstream, self.request, self.resp, self.headers = upstream, request, resp, headers
        self.claim, self.rec, self.first, self.resume, self.kv_from = claim, rec, first, resume, kv_from
        self.events = EventStream(rename)
        self.end = StreamEnd(rec.endpoint)
        self.out: StreamOut | None = resume.out if resume is not None else None
        self.stopped: list[str] = []  # why the engine's bytes stopped coming: ejected, prefill_lost
        self.watch = PrefillWatch(kv_from, resp, self.stopped)
        self.error: bytes | None = None  # a plain stream's error event, once it broke
        self.finished = False

    async def run(self) -> Reply | StreamOut:
        resume, replica = self.resume, self.claim.replica
        if resume is not None:  # followed: stop waiting on a replica its health checks ejected
            replica.on_eject.add(self._ejected)
        try:
            if self.out is None and (resume is None or not resume.buffered):
                self.out = await self.request.stream(self.resp.status, self.headers)
                if resume is not None:
                    resume.out = self.out
            failure = await self._pump()
            if resume is None:
                return await self._end_plain()
            return await self._end_followed(resume, failure)
        except ConnectionResetError:
            client_left(self.end, self.rec)
            return self.out if self.out is not None else Reply(499)  # gone before the status line
        finally:
            if resume is not None:
                self.rec.resume_blocked = resume.blocked
                replica.on_eject.discard(self._ejected)
            self.watch.close()
            if self.finished:
                self.resp.release()
            else:
                self.rec.completed = self.rec.completed or self.end.complete
                # The client left (or we were cancelled): drop the upstream connection so the
                # engine aborts the request instead of generating for nobody.
                self.resp.close()

    def _ejected(self) -> None:
        self.stopped.append("ejected")
        self.resp.close()

    async def _pump(self) -> str | None:
        """Relay the engine's events until its stream ends or fails: why it failed (None: it ended)."""
        resume, rec = self.resume, self.rec
        text_before = len(resume.sent_text()) if resume is not None and self.kv_from is not None else 0
        try:
            async for chunk in self.upstream.chunks(self.resp):
                self.watch.heard = True
                if rec.first_byte_at is None:
                    rec.first_byte_at = time.perf_counter()
                    if self.first is not None:
                        self.first()
                chunk = self.events.feed(chunk)
                if resume is not None:
                    chunk = resume.feed(chunk)
                if chunk:  # a client that asked no stream has its answer assembled instead
                    await self._write(chunk)
                if resume is not None and resume.failure is not None:
                    break
            else:
                tail = self.events.flush()
                if resume is not None:
                    tail = resume.feed(tail)
                if tail:
                    await self._write(tail)
        except UpstreamError as exc:
            return self._broke(exc)
        if resume is None:
            return None
        failure = resume.failure or (None if resume.done else "closed_early")
        if failure == "engine_error" and self.kv_from is not None and len(resume.sent_text()) == text_before:
            # An error before any text of a decode leg that was to load its prompt's KV: the
            # connector's decode replica could not load it, and can serve the request whole.
            failure = "kv_load_failed"
        if failure in ("malformed_event", "closed_early"):
            what = "a malformed event" if failure == "malformed_event" else "no end to its stream"
            resume.error_event = sse_error_event(f"engine sent {what}", "upstream_stream_error")
        return failure

    async def _write(self, chunk: bytes) -> None:
        assert self.out is not None
        if USAGE_MARK in chunk:
            read_usage(chunk, self.rec)
        await self.out.write(chunk)
        self.end.feed(chunk)

    def _broke(self, exc: UpstreamError) -> str:
        """The engine's stream failed: why, and what the client is told should nobody go on."""
        if exc.replica_fault:
            self.claim.failed()
        log.warning("request %s: stream from upstream failed: %s", self.rec.request_id, exc)
        stopped = self.stopped[0] if self.stopped else None
        failure = stopped or ("idle_timeout" if exc.code == "upstream_timeout" else "disconnected")
        message = PREFILL_LOST if failure == "prefill_lost" else exc.client_message(self.claim.replica.name)
        event = sse_error_event(message, "upstream_stream_error")
        if self.resume is None:
            self.error = event
        else:
            self.resume.error_event = event
        return failure

    async def _end_plain(self) -> StreamOut:
        out = self.out
        assert out is not None
        if self.error is not None:  # never truncate silently: the client learns the stream broke
            self.rec.error_code = "upstream_stream_error"
            await out.write(self.error)
        await out.write_eof()
        self.finished = True
        return out

    async def _end_followed(self, resume: Resume, failure: str | None) -> Reply | StreamOut:
        out = self.out
        if failure is not None and resume.whole:
            # Only the stream's end was lost ([DONE], or the connection's close after it): the
            # client has the whole answer, and gets the end it expects.
            failure = None
            if not resume.done and out is not None:
                await self._write(_DONE)
        if failure is not None and resume.continuable:
            raise Cut(failure)
        if resume.buffered:
            return self._assembled(resume, failure)
        assert out is not None
        if failure is not None:
            self.rec.error_code = "upstream_stream_error"
            await out.write(resume.error_event or sse_error_event(failure, "upstream_stream_error"))
        await out.write_eof()
        self.finished = True
        return out

    def _assembled(self, resume: Resume, failure: str | None) -> Reply:
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
        self.rec.completed = self.finished = True
        read_usage(orjson.dumps({"usage": resume.usage}), self.rec)
        self.headers["Content-Type"] = "application/json"
        return Reply(self.resp.status, resume.assembled(), self.headers)  # of events already renamed
