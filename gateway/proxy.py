"""The inference request path: parse, resolve the pool, canonicalize, schedule, route, relay.

Every request ends in exactly one of: the engine's answer relayed byte-for-byte, or an
OpenAI-style error. Load taken on a replica is released exactly once, whether the request
succeeds, fails, times out or the client goes away.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import random
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.canonicalize import canonicalize
from gateway.claim import Claim
from gateway.errors import GatewayError, error_body, normalize_error_body
from gateway.limits import ShedError
from gateway.logs import clip
from gateway.model_catalog import Target
from gateway.pd import DecodePlan, PDHandoff
from gateway.policy import Candidate, RequestFeatures
from gateway.prefix_hash import PrefixHasher
from gateway.replica import Replica
from gateway.request_body import client_error, parse_json_body, read_body
from gateway.request_record import RequestRecord
from gateway.sanitize import (
    client_request_id,
    invalid_header,
    new_request_id,
    strip_body,
    upstream_headers,
)
from gateway.sse_events import EventStream
from gateway.stream_end import StreamEnd
from gateway.tokens import engine_prompt_tokens
from gateway.tracing import NOOP
from gateway.transports.base import Response
from gateway.upstream import ERROR_BODY_LIMIT, UpstreamError

if TYPE_CHECKING:
    from gateway.pool import Pool
    from gateway.runtime import Runtime

log = logging.getLogger(__name__)

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
}
TARGET = web.RequestKey("kvgate_target", Target)
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


_USAGE = b'"prompt_tokens":'


def sse_error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"


class Proxy:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.settings = runtime.settings
        self.pd = PDHandoff(runtime.upstream, resend=runtime.settings.retry.max_attempts >= 2)

    # -- entry point ------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        # Engines get an id the gateway makes; the client's own id, when usable, names the
        # request in logs and in the answer's X-Request-Id.
        engine_id = new_request_id()
        client_id = client_request_id(request.headers.get("x-request-id"))
        rec = RequestRecord(client_id or engine_id, ENDPOINTS[request.path], engine_request_id=engine_id)
        tr = self.rt.tracing
        root = tr.request(request.method, request.path, request.headers, rec) if tr else None
        try:
            response = await self._handle(request, rec)
        except GatewayError as exc:
            response = self.error_response(exc, rec)
        except asyncio.CancelledError:
            if not rec.completed:  # a client that closes after the end of its stream got its answer
                rec.client_disconnected = True
                rec.status = 499  # nginx's "client closed request": nobody received an answer
            raise
        finally:
            rec.ended = time.perf_counter()
            self.rt.observe(rec)
            if root is not None:
                root.end(rec)
        return response

    async def _handle(self, request: web.Request, rec: RequestRecord) -> web.StreamResponse:
        server = self.settings.server
        bad_header = invalid_header(request.headers.items())
        if bad_header is not None:
            raise client_error(
                f"header {clip(bad_header, 64)!r}: values may hold only visible ASCII, spaces and tabs",
                "invalid_header",
            )
        tenant = self.rt.auth.client(request)
        rec.tenant = tenant
        raw = await read_body(request, server.max_body_bytes, server.body_timeout_s)
        # A large body is parsed, canonicalized, hashed and counted in a worker thread: on the event
        # loop a 7.5 MB prompt took 0.6 s, during which no other request moved.
        offload = len(raw) > server.offload_body_bytes
        loop = asyncio.get_running_loop()
        if offload:
            body = await loop.run_in_executor(self.rt.workers, parse_json_body, raw, server.max_json_depth)
        else:
            body = parse_json_body(raw, server.max_json_depth)
        model = body.get("model")
        if model is None or model == "":
            raise client_error("you must provide a model parameter", "missing_model", "model")
        if not isinstance(model, str):
            raise client_error("`model` must be a string", "invalid_model", "model")
        rec.model = clip(model)
        target = request[TARGET] = self.rt.models.resolve(model, rec.endpoint, request.headers, body)
        pool = target.pool
        rec.pool = pool.name
        removed = strip_body(body, pool.passthrough_fields)
        if removed:
            log.debug("request %s: client fields not for engines removed: %s", rec.request_id, removed)
        changed = bool(removed)
        if model != target.upstream:
            body["model"] = target.upstream
            changed = True
        if offload:
            # The worker reads the pool's caches through a detached hasher; what it learned joins
            # them back here, on the loop.
            hasher = pool.hasher.detached()
            call = contextvars.copy_context().run
            job = functools.partial(call, self._prompt, pool, body, rec, request.headers, hasher)
            body, canonicalized, features = await loop.run_in_executor(self.rt.workers, job)
            pool.hasher.absorb(hasher)
            pool.learn_token_size(len(features.text), features.prompt_tokens)
        else:
            body, canonicalized, features = self._prompt(pool, body, rec, request.headers)
        changed = canonicalized or changed
        scheduler = self.rt.scheduler
        features.tenant = tenant
        changed = scheduler.classify(features, request.headers, body) or changed
        trimmed = scheduler.fit_prompt(pool, features, body)
        if trimmed is not None:  # the window policy dropped the oldest turns
            features, changed = trimmed, True
        changed = scheduler.forward_priority(pool, features, body) or changed
        tr = self.rt.tracing
        if pool.precise is not None and pool.policy.uses_prefix_match:
            with tr.span("tokenize") if tr else NOOP:
                await pool.precise.annotate(features, body, pool.serving("decode"), self.rt.upstream)
        out = orjson.dumps(body) if changed else raw
        rec.stream = features.stream
        rec.prompt_tokens = features.prompt_tokens
        rec.prompt_chars = len(features.text)
        rec.priority_class = features.priority_class
        queued_at = time.perf_counter()
        with tr.span("queue", {"kvgate.priority_class": features.priority_class}) if tr else NOOP:
            ticket = await self.rt.scheduler.admit(pool, features)
        rec.queued_s = time.perf_counter() - queued_at
        try:
            return await self._dispatch(request, pool, features, body, out, rec)
        finally:
            ticket.release()

    def _prompt(
        self,
        pool: Pool,
        body: dict[str, Any],
        rec: RequestRecord,
        headers: Mapping[str, str],
        hasher: PrefixHasher | None = None,
    ) -> tuple[dict[str, Any], bool, RequestFeatures]:
        """Canonicalize (when the pool does) and measure the prompt; True when the body changed.
        With a detached `hasher` it runs off the event loop and touches none of the pool's state."""
        changed = False
        canon = pool.cfg.canonicalize
        if canon.enabled and not headers.get(canon.opt_out_header):
            tr = self.rt.tracing
            with tr.span("canonicalize") if tr else NOOP:
                result = canonicalize(body, canon, rec.endpoint)
            if result.body is not body:
                body, changed = result.body, True
                log.debug("request %s canonicalized: %s", rec.request_id, "; ".join(result.notes))
        features = pool.features(body, rec.endpoint, rec.engine_request_id, headers, hasher)
        return body, changed, features

    def error_response(self, exc: GatewayError, rec: RequestRecord) -> web.Response:
        rec.status = exc.status
        rec.error_code = exc.code
        if isinstance(exc, ShedError):
            rec.shed_reason = exc.shed_reason
        headers = {"x-request-id": rec.request_id, **exc.headers}
        return web.Response(
            status=exc.status, body=exc.body(), content_type="application/json", headers=headers
        )

    # -- dispatch with retries ----------------------------------------------------------------
    def _upstream_headers(self, request: web.Request, pool: Pool, rec: RequestRecord) -> dict[str, str]:
        return upstream_headers(request.headers.items(), pool.passthrough_headers, rec.engine_request_id)

    async def _dispatch(
        self,
        request: web.Request,
        pool: Pool,
        features: RequestFeatures,
        body: dict[str, Any],
        raw: bytes,
        rec: RequestRecord,
    ) -> web.StreamResponse:
        request_id = rec.request_id
        tr = self.rt.tracing
        with tr.span("route", {"kvgate.policy": pool.cfg.policy.type}) if tr else NOOP:
            ranked = await pool.rank(features)
        if not ranked:
            raise self._no_replica(f"no healthy replica in pool `{pool.name}`")
        retry_cfg = self.settings.retry
        max_attempts = retry_cfg.max_attempts
        budget = self.rt.retry_budget
        budget.on_request()
        headers = self._upstream_headers(request, pool, rec)
        plan = DecodePlan(raw)
        refused: GatewayError | None = None  # the last retryable answer, relayed if every try fails
        failure: UpstreamError | None = None  # the last retryable transport failure
        # A generation is not idempotent: it may reach engines at most max_attempts times in
        # all, a stale keep-alive connection's silent resend included.
        deliveries = 0
        try:
            if pool.disaggregated and self.pd.wanted(pool, features, ranked[0]):
                plan = await self.pd.prepare(pool, features, body, raw, request.path, headers)
            for attempt, candidate in enumerate(_walk(ranked, max_attempts)):
                if deliveries >= max_attempts:
                    break
                replica: Replica = candidate.replica  # type: ignore[assignment]
                if attempt > 0:
                    if not budget.try_spend():
                        break
                    rec.retries += 1
                    delay = min(retry_cfg.backoff_max_s, retry_cfg.backoff_initial_s * 2 ** (attempt - 1))
                    await asyncio.sleep(delay * (0.5 + random.random() / 2))
                if features.adapter is not None and not await pool.lora.ensure(
                    replica, features.adapter, self.rt.lora.session
                ):
                    continue  # the adapter could not be loaded there
                claim = Claim.take(replica, features.prompt_tokens)
                if claim is None:
                    continue
                with claim:
                    # Learn at decision time, not when the answer comes: concurrent requests with
                    # the same new prefix must see where the first one went.
                    pool.learn(features, replica)
                    up = tr.upstream(replica, attempt, headers) if tr else None
                    try:
                        try:
                            url = replica.url + request.path
                            resend = deliveries + 2 <= max_attempts
                            hdrs = up.headers if up is not None else headers
                            resp = await self._open(url, plan, hdrs, resend)
                        except UpstreamError as exc:
                            deliveries += exc.sent
                            if exc.replica_fault:
                                claim.failed()
                            log.warning("request %s: replica %s failed: %s", request_id, replica.name, exc)
                            if not exc.retryable:
                                raise exc.gateway_error() from None
                            failure = exc
                            continue
                        deliveries += resp.sent
                        claim.answered()  # any well-formed answer: the engine is up
                        if up is not None:
                            up.responded(resp.status)
                        if resp.status in retry_cfg.retry_statuses:
                            error = normalize_error_body(await self._read_error(resp), resp.status)
                            refused = GatewayError(
                                resp.status, "refused", headers=_retry_after(resp), body=error
                            )
                            log.info(
                                "request %s: replica %s answered %d", request_id, replica.name, resp.status
                            )
                            continue
                        rec.replica = replica.name
                        rec.matched_tokens = candidate.matched_tokens
                        rec.route_reason = (
                            route_reason(candidate, ranked) if pool.policy.uses_prefix_match else None
                        )
                        return await self._relay(request, resp, claim, rec)
                    finally:
                        if up is not None:
                            up.end(rec)
        finally:
            await plan.finish()
        if refused is not None:
            raise refused
        if failure is not None:
            raise failure.gateway_error()
        raise self._no_replica(f"no replica of pool `{pool.name}` accepted the request")

    def _no_replica(self, message: str) -> GatewayError:
        retry_after = str(self.settings.scheduler.retry_after_s)
        return GatewayError(
            503, message, "service_unavailable", "no_healthy_replica", headers={"Retry-After": retry_after}
        )

    async def _open(self, url: str, plan: DecodePlan, headers: dict[str, str], resend: bool) -> Response:
        """Open the decode leg; with a concurrent prefill leg, fail fast if that leg breaks first."""
        upstream = self.rt.upstream
        if plan.guard is None:
            return await upstream.open("POST", url, plan.body, headers, resend=resend)
        opening = asyncio.ensure_future(upstream.open("POST", url, plan.body, headers, resend=resend))
        try:
            await asyncio.wait({opening, plan.guard}, return_when=asyncio.FIRST_COMPLETED)
            if not opening.done() and plan.guard.exception() is not None:
                # The decode replica is not at fault: its bootstrap partner went away.
                raise UpstreamError(
                    f"prefill leg failed: {plan.guard.exception()}",
                    code="upstream_prefill_failed",
                    replica_fault=False,
                )
            return await opening
        except BaseException:
            await _abandon(opening)
            raise

    async def _read_error(self, resp: Response) -> bytes:
        try:
            return await self.rt.upstream.read_content(resp, ERROR_BODY_LIMIT)
        except UpstreamError:
            return b""
        finally:
            resp.release()

    # -- relay -----------------------------------------------------------------------------
    def _response_headers(
        self, resp: Response, replica: Replica, request_id: str, drop: frozenset[str] = _DROP_RESPONSE
    ) -> dict[str, str]:
        headers = {k: v for k, v in resp.headers if k.lower() not in drop}
        headers["x-request-id"] = request_id
        headers["x-kvgate-replica"] = replica.name
        headers["x-kvgate-pool"] = replica.pool
        return headers

    async def _relay(
        self,
        request: web.Request,
        resp: Response,
        claim: Claim,
        rec: RequestRecord,
    ) -> web.StreamResponse:
        rec.status = resp.status
        if resp.status >= 400:
            # Rewritten in the OpenAI form, decoded: the engine's Content-Encoding no longer applies.
            headers = self._response_headers(resp, claim.replica, rec.request_id, _DROP_REWRITTEN)
            raw = await self._read_error(resp)
            headers["Content-Type"] = "application/json"
            return web.Response(
                status=resp.status, body=normalize_error_body(raw, resp.status), headers=headers
            )
        headers = self._response_headers(resp, claim.replica, rec.request_id)
        if not resp.content_type.startswith("text/event-stream"):
            try:
                raw = await self.rt.upstream.read(resp)
            except UpstreamError as exc:
                if exc.replica_fault:
                    claim.failed()
                raise exc.gateway_error() from None
            finally:
                resp.release()
            rec.first_byte_at = time.perf_counter()
            rec.engine_prompt_tokens = engine_prompt_tokens(raw)
            rename = request[TARGET].rename
            if rename is not None and not resp.header("Content-Encoding"):
                raw = rename.apply(raw)
            return web.Response(status=resp.status, body=raw, headers=headers)
        return await self._relay_stream(request, resp, headers, claim, rec)

    async def _relay_stream(
        self,
        request: web.Request,
        resp: Response,
        headers: dict[str, str],
        claim: Claim,
        rec: RequestRecord,
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers=headers)
        finished = False
        events = EventStream(request[TARGET].rename)
        end = StreamEnd(rec.endpoint)
        try:
            await out.prepare(request)
            try:
                async for chunk in self.rt.upstream.chunks(resp):
                    if rec.first_byte_at is None:
                        rec.first_byte_at = time.perf_counter()
                    chunk = events.feed(chunk)
                    if not chunk:
                        continue
                    if _USAGE in chunk:  # a substring test per chunk; only a usage chunk is read
                        rec.engine_prompt_tokens = engine_prompt_tokens(chunk) or rec.engine_prompt_tokens
                    await out.write(chunk)
                    end.feed(chunk)
                tail = events.flush()
                if tail:
                    await out.write(tail)
                    end.feed(tail)
            except UpstreamError as exc:
                if exc.replica_fault:
                    claim.failed()
                # Never truncate silently: the client learns the stream broke.
                log.warning("request %s: stream from upstream failed: %s", rec.request_id, exc)
                rec.error_code = "upstream_stream_error"
                await out.write(sse_error_event(str(exc), "upstream_stream_error"))
            await out.write_eof()
            finished = True
        except ConnectionResetError:
            rec.completed = end.complete
            if not rec.completed:
                rec.client_disconnected = True
                log.info("request %s: client went away mid-stream", rec.request_id)
        finally:
            if finished:
                resp.release()
            else:
                rec.completed = end.complete  # read by `handle` if this is a cancellation
                # The client left (or we were cancelled): drop the upstream connection so the
                # engine aborts the request instead of generating for nobody.
                resp.close()
        return out


def route_reason(chosen: Candidate, ranked: list[Candidate]) -> str:
    """How a prefix-aware choice relates to the cache: `cold` when no replica held any of the
    prompt, `cache_hit` when the chosen one held the most, `spill` when a warmer one was passed
    over (its queue made it slower, or it failed)."""
    best = max(c.matched_tokens for c in ranked)
    if best == 0:
        return "cold"
    return "cache_hit" if chosen.matched_tokens == best else "spill"


def _walk(ranked: list[Candidate], attempts: int) -> list[Candidate]:
    """The replicas to try, best first, wrapping around when there are fewer than attempts."""
    return [ranked[i % len(ranked)] for i in range(attempts)]


async def _abandon(opening: asyncio.Future[Response]) -> None:
    """Stop an opening nobody will read; an answer that arrived anyway is closed, not leaked."""
    opening.cancel()
    await asyncio.gather(opening, return_exceptions=True)
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _retry_after(resp: Response) -> dict[str, str]:
    value = resp.header("Retry-After")
    return {"Retry-After": value} if value else {}
