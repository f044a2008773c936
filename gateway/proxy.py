"""The inference request path: parse, resolve the pool, canonicalize, schedule, route, relay.

Every request ends in exactly one of: the engine's answer relayed byte-for-byte, or an
OpenAI-style error. Load taken on a replica is released exactly once, whether the request
succeeds, fails, times out or the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.canonicalize import canonicalize
from gateway.errors import GatewayError, error_body, normalize_error_body
from gateway.http1 import UpstreamResponse
from gateway.limits import ShedError
from gateway.model_catalog import Target
from gateway.pd import DecodePlan, PDHandoff
from gateway.policy import Candidate, RequestFeatures
from gateway.replica import Replica
from gateway.request_record import RequestRecord
from gateway.sse_events import EventStream
from gateway.tracing import NOOP
from gateway.upstream import UpstreamError

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
# Not forwarded either way: hop-by-hop, framing the proxy redoes, and the gateway's own auth.
_DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "authorization",
        "cookie",
        "accept-encoding",
        "expect",
    }
)
_DROP_RESPONSE = frozenset(
    {
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "server",
        "date",
        "content-encoding",
        "x-request-id",
        "x-kvgate-replica",
        "x-kvgate-pool",
    }
)


def _client_error(message: str, code: str, param: str | None = None, status: int = 400) -> GatewayError:
    return GatewayError(status, message, "invalid_request_error", code, param)


async def read_body(request: web.Request, limit: int) -> bytes:
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _client_error(f"request body exceeds {limit} bytes", "request_too_large", status=413)
    if declared is not None:
        try:
            return await request.content.readexactly(declared) if declared else b""
        except asyncio.IncompleteReadError:
            raise _client_error("request body shorter than its Content-Length", "invalid_body") from None
    # Chunked upload: no declared size, so count as it arrives.
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _client_error(f"request body exceeds {limit} bytes", "request_too_large", status=413)
        parts.append(chunk)
    return b"".join(parts)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise _client_error("request body is empty; expected a JSON object", "invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _client_error(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _client_error("request body must be a JSON object", "invalid_json")
    return body


def sse_error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"


class Proxy:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.settings = runtime.settings
        self.pd = PDHandoff(runtime.upstream)

    # -- entry point ------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
        rec = RequestRecord(request_id, ENDPOINTS[request.path])
        tr = self.rt.tracing
        root = tr.request(request.method, request.path, request.headers, rec) if tr else None
        try:
            response = await self._handle(request, rec)
        except GatewayError as exc:
            response = self.error_response(exc, rec)
        except asyncio.CancelledError:
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
        endpoint = rec.endpoint
        tr = self.rt.tracing
        tenant = self.rt.auth.client(request)
        rec.tenant = tenant
        raw = await read_body(request, self.settings.server.max_body_bytes)
        body = parse_json_body(raw)
        model = body.get("model")
        if model is None or model == "":
            raise _client_error("you must provide a model parameter", "missing_model", "model")
        if not isinstance(model, str):
            raise _client_error("`model` must be a string", "invalid_model", "model")
        rec.model = model
        target = request[TARGET] = self.rt.models.resolve(model, endpoint, request.headers, body)
        pool = target.pool
        rec.pool = pool.name
        changed = False
        canon = pool.cfg.canonicalize
        if canon.enabled and not request.headers.get(canon.opt_out_header):
            with tr.span("canonicalize") if tr else NOOP:
                result = canonicalize(body, canon, endpoint)
            if result.body is not body:
                body, changed = result.body, True
                log.debug("request %s canonicalized: %s", rec.request_id, "; ".join(result.notes))
        if model != target.upstream:
            body["model"] = target.upstream
            changed = True
        scheduler = self.rt.scheduler
        features = pool.features(body, endpoint, rec.request_id, request.headers)
        features.tenant = tenant
        changed = scheduler.classify(features, request.headers, body) or changed
        trimmed = scheduler.fit_prompt(pool, features, body)
        if trimmed is not None:  # the window policy dropped the oldest turns
            features, changed = trimmed, True
        changed = scheduler.forward_priority(pool, features, body) or changed
        if pool.precise is not None and pool.policy.uses_prefix_match:
            with tr.span("tokenize") if tr else NOOP:
                await pool.precise.annotate(features, body, pool.serving("decode"), self.rt.upstream)
        out = orjson.dumps(body) if changed else raw
        rec.stream = features.stream
        rec.prompt_tokens = features.prompt_tokens
        rec.priority_class = features.priority_class
        queued_at = time.perf_counter()
        with tr.span("queue", {"kvgate.priority_class": features.priority_class}) if tr else NOOP:
            ticket = await self.rt.scheduler.admit(pool, features)
        rec.queued_s = time.perf_counter() - queued_at
        try:
            return await self._dispatch(request, pool, features, body, out, rec)
        finally:
            ticket.release()

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
    def _upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        headers["X-Request-Id"] = request_id  # replaces the client's under any spelling (dropped above)
        headers["Content-Type"] = "application/json"
        return headers

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
        budget = self.rt.retry_budget
        budget.on_request()
        headers = self._upstream_headers(request, request_id)
        plan = DecodePlan(raw)
        if pool.disaggregated and self.pd.wanted(pool, features, ranked[0]):
            plan = await self.pd.prepare(pool, features, body, raw, request.path, headers)
        refused: GatewayError | None = None  # the last retryable answer, relayed if every try fails
        unreachable: GatewayError | None = None
        try:
            for attempt, candidate in enumerate(_walk(ranked, retry_cfg.max_attempts)):
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
                if not replica.breaker.try_acquire():
                    continue
                lease = replica.lease(features.prompt_tokens)
                # Learn at decision time, not when the answer comes: concurrent requests with the
                # same new prefix must see where the first one went.
                pool.learn(features, replica)
                up = tr.upstream(replica, attempt, headers) if tr else None
                try:
                    try:
                        url = replica.url + request.path
                        resp = await self._open(url, plan, up.headers if up is not None else headers)
                    except UpstreamError as exc:
                        replica.breaker.record_failure()
                        log.warning("request %s: replica %s failed: %s", request_id, replica.name, exc)
                        if not exc.connect:
                            raise GatewayError(504, str(exc), "upstream_error", "upstream_timeout") from None
                        unreachable = GatewayError(502, str(exc), "upstream_error", "upstream_unreachable")
                        continue
                    if up is not None:
                        up.responded(resp.status)
                    if resp.status in retry_cfg.retry_statuses:
                        if resp.status == 429:  # busy, not broken: no mark against its health
                            replica.breaker.release_probe()
                        else:
                            replica.breaker.record_failure()
                        error = normalize_error_body(await self._read_error(resp), resp.status)
                        refused = GatewayError(resp.status, "refused", headers=_retry_after(resp), body=error)
                        log.info("request %s: replica %s answered %d", request_id, replica.name, resp.status)
                        continue
                    if resp.status >= 500:
                        replica.breaker.record_failure()
                    else:
                        replica.breaker.record_success()
                    rec.replica = replica.name
                    rec.matched_tokens = candidate.matched_tokens
                    rec.route_reason = (
                        route_reason(candidate, ranked) if pool.policy.uses_prefix_match else None
                    )
                    return await self._relay(request, resp, replica, rec)
                finally:
                    lease.release()
                    if up is not None:
                        up.end(rec)
        finally:
            await plan.finish()
        if refused is not None:
            raise refused
        if unreachable is not None:
            raise unreachable
        raise self._no_replica(f"no replica of pool `{pool.name}` accepted the request")

    def _no_replica(self, message: str) -> GatewayError:
        retry_after = str(self.settings.scheduler.retry_after_s)
        return GatewayError(
            503, message, "service_unavailable", "no_healthy_replica", headers={"Retry-After": retry_after}
        )

    async def _open(self, url: str, plan: DecodePlan, headers: dict[str, str]) -> UpstreamResponse:
        """Open the decode leg; with a concurrent prefill leg, fail fast if that leg breaks first."""
        if plan.guard is None:
            return await self.rt.upstream.open("POST", url, plan.body, headers)
        opening = asyncio.ensure_future(self.rt.upstream.open("POST", url, plan.body, headers))
        await asyncio.wait({opening, plan.guard}, return_when=asyncio.FIRST_COMPLETED)
        if not opening.done() and plan.guard.exception() is not None:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            raise UpstreamError(f"prefill leg failed: {plan.guard.exception()}")
        return await opening

    async def _read_error(self, resp: UpstreamResponse) -> bytes:
        try:
            return await self.rt.upstream.read(resp)
        except UpstreamError:
            return b""
        finally:
            resp.release()

    # -- relay -----------------------------------------------------------------------------
    def _response_headers(self, resp: UpstreamResponse, replica: Replica, request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in resp.headers if k.lower() not in _DROP_RESPONSE}
        headers["x-request-id"] = request_id
        headers["x-kvgate-replica"] = replica.name
        headers["x-kvgate-pool"] = replica.pool
        return headers

    async def _relay(
        self,
        request: web.Request,
        resp: UpstreamResponse,
        replica: Replica,
        rec: RequestRecord,
    ) -> web.StreamResponse:
        headers = self._response_headers(resp, replica, rec.request_id)
        rec.status = resp.status
        if resp.status >= 400:
            raw = await self._read_error(resp)
            headers["Content-Type"] = "application/json"
            return web.Response(
                status=resp.status, body=normalize_error_body(raw, resp.status), headers=headers
            )
        if not resp.content_type.startswith("text/event-stream"):
            try:
                raw = await self.rt.upstream.read(resp)
            except UpstreamError as exc:
                raise GatewayError(502, str(exc), "upstream_error", "upstream_disconnected") from None
            finally:
                resp.release()
            rec.first_byte_at = time.perf_counter()
            rename = request[TARGET].rename
            if rename is not None and not resp.header("Content-Encoding"):
                raw = rename.apply(raw)
            return web.Response(status=resp.status, body=raw, headers=headers)
        return await self._relay_stream(request, resp, headers, rec)

    async def _relay_stream(
        self,
        request: web.Request,
        resp: UpstreamResponse,
        headers: dict[str, str],
        rec: RequestRecord,
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers=headers)
        finished = False
        events = EventStream(request[TARGET].rename)
        try:
            await out.prepare(request)
            try:
                async for chunk in self.rt.upstream.chunks(resp):
                    if rec.first_byte_at is None:
                        rec.first_byte_at = time.perf_counter()
                    chunk = events.feed(chunk)
                    if chunk:
                        await out.write(chunk)
                tail = events.flush()
                if tail:
                    await out.write(tail)
            except UpstreamError as exc:
                # Never truncate silently: the client learns the stream broke.
                log.warning("request %s: stream from upstream failed: %s", rec.request_id, exc)
                rec.error_code = "upstream_stream_error"
                await out.write(sse_error_event(str(exc), "upstream_stream_error"))
            await out.write_eof()
            finished = True
        except ConnectionResetError:
            rec.client_disconnected = True
            log.info("request %s: client went away mid-stream", rec.request_id)
        finally:
            if finished:
                resp.release()
            else:
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


def _retry_after(resp: UpstreamResponse) -> dict[str, str]:
    value = resp.header("Retry-After")
    return {"Retry-After": value} if value else {}
