"""Admission and dispatch: a prepared request waits for its admission, is ranked across its
pool's replicas, sent (plainly or through a prefill/decode hand-off, retried on another replica
before the first byte; a LoRA adapter loaded there first when needed), and its answer relayed.

Every request ends in exactly one of: the engine's answer relayed byte-for-byte but for the
model's name (the client's, not the engine's: gateway/path/model_names.py), or an OpenAI-style
error. Load taken on a replica is released exactly once, whether the request
succeeds, fails, times out or the client goes away; and the pool's policy hears how each request
it ranked ended (`on_complete`), exactly once too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import orjson

from gateway.admission.scheduler import Scheduler
from gateway.config import RetryConfig
from gateway.errors import GatewayError, normalize_error_body
from gateway.fleet.replica import Replica
from gateway.path.claim import Claim
from gateway.path.exchange import Exchange, Reply, StreamOut
from gateway.path.model_names import ModelRename
from gateway.path.pd import PREFILL_LOST, DecodePlan, PDHandoff, PrefillWatch
from gateway.path.prepare import Preparation
from gateway.path.request import InferenceRequest
from gateway.path.request_record import USAGE_MARK, RequestRecord, read_usage
from gateway.path.resume import Resume, resumable
from gateway.path.resume_relay import HANDOFF_FAILURES, Cut, relay_resumable
from gateway.path.retry_budget import RetryBudget
from gateway.path.sanitize import upstream_headers
from gateway.path.sse_events import EventStream, sse_error_event
from gateway.path.stream_end import StreamEnd, client_left
from gateway.path.trace import Tracer
from gateway.path.transports.base import Response
from gateway.path.upstream import ERROR_BODY_LIMIT, Upstream, UpstreamError
from gateway.prompt.tokens import get_tokenizer
from gateway.routing.lora import LoraWatch
from gateway.routing.policy import Candidate, Outcome, RequestFeatures
from gateway.routing.pool_router import PoolRouter

log = logging.getLogger(__name__)

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


class Proxy:
    """Admission and dispatch of prepared requests: the request path after the preparation step."""

    def __init__(
        self,
        retry: RetryConfig,
        retry_after_s: float,
        preparation: Preparation,
        scheduler: Scheduler,
        upstream: Upstream,
        retry_budget: RetryBudget,
        tracer: Tracer,
        lora: LoraWatch,
    ) -> None:
        self.retry = retry
        self.retry_after_s = retry_after_s  # what a 503 for want of replicas tells the client
        self.preparation = preparation
        self.scheduler = scheduler
        self.upstream = upstream
        self.retry_budget = retry_budget
        self.tracer = tracer
        self.lora = lora  # loads LoRA adapters onto replicas on demand
        self.pd = PDHandoff(upstream, resend=retry.max_attempts >= 2)

    async def handle(
        self, request: Exchange, raw: bytes, tenant: str | None, rec: RequestRecord
    ) -> Reply | StreamOut:
        """A client's request, its body read and its tenant known: prepare, admit, dispatch."""
        req = await self.preparation.prepare(request.path, request.headers, raw, tenant, rec)
        queued_at = time.perf_counter()
        with self.tracer.span("queue", {"kvgate.priority_class": req.features.priority_class}):
            ticket = await self.scheduler.admit(req.router, req.features)
        rec.queued_s = time.perf_counter() - queued_at
        with ticket:
            return await self._dispatch(request, req)

    # -- dispatch with retries ----------------------------------------------------------------
    async def _dispatch(self, request: Exchange, req: InferenceRequest) -> Reply | StreamOut:
        router, features, rec = req.router, req.features, req.record
        pool = router.pool
        paired = pool.disaggregated
        with self.tracer.span("route", {"kvgate.policy": pool.cfg.policy.type}):
            if paired:
                pair = router.select_pair(features)
                ranked, prefills = pair.decode, pair.prefill
            else:
                ranked, prefills = router.rank(features), []
        # From here the policy has decided: it hears how the request ended, exactly once, on
        # every path (an answer, an error, a retry's end, the client leaving, cancellation).
        track = _Track()
        try:
            response = await self._walk(request, req, ranked, prefills, track)
        except asyncio.CancelledError:
            # A client that closes after the end of its stream got its answer.
            track.error = None if rec.completed else "client_disconnected"
            raise
        except GatewayError as exc:
            track.status = exc.status
            raise
        else:
            track.status = rec.status
            track.error = (
                "engine_error"
                if rec.status >= 400
                else "client_disconnected"
                if rec.client_disconnected
                else "upstream_error"
                if rec.error_code is not None
                else None
            )
            return response
        finally:
            if router.completion_heard(paired):
                router.complete(features, track.replica, track.outcome(rec, features), paired)

    async def _walk(
        self,
        request: Exchange,
        req: InferenceRequest,
        ranked: list[Candidate],
        prefills: list[Candidate],
        track: _Track,
    ) -> Reply | StreamOut:
        """Send the request down the ranking (and a prefill leg first when it pays), retrying
        before the first byte; `track` follows where it went and why it failed."""
        router, features, rec = req.router, req.features, req.record
        pool = router.pool
        request_id = rec.request_id
        tracer = self.tracer
        if not ranked:
            track.error = "no_replica"
            raise self._no_replica(f"no healthy replica in pool `{pool.name}`")
        retry_cfg = self.retry
        max_attempts = retry_cfg.max_attempts
        budget = self.retry_budget
        budget.on_request()
        headers = upstream_headers(request.headers.items(), pool.passthrough_headers, rec.engine_request_id)
        raw = req.payload()
        plan = DecodePlan(raw, raw)
        resume = self._resume(request, req)
        learned = features  # what the replica taking the request is taught it holds
        resumed_at = -1  # the attempt that first continues the answer (no backoff before it)
        refused: GatewayError | None = None  # the last retryable answer, relayed if every try fails
        failure: GatewayError | None = None  # the last retryable transport failure
        # A generation is not idempotent: it may reach engines at most max_attempts times in
        # all, a stale keep-alive connection's silent resend included.
        deliveries = 0
        try:
            skip = self.pd.skip(pool, features, ranked[0]) if prefills else None
            if skip is not None:
                rec.pd = skip
            elif prefills:
                try:
                    plan = await self.pd.prepare(
                        router, features, prefills, req.body, raw, request.path, headers
                    )
                except GatewayError:
                    track.error = "engine_error"  # the prefill leg's refusal is the client's answer
                    raise
                track.prefill = plan.prefill.name if plan.prefill is not None else None
                rec.pd = "decode_only" if plan.body is plan.alone else "handoff"
            body, guard = plan.body, plan.guard
            handoff = body is not plan.alone  # the decode leg carries a prefill leg's KV
            if resume is not None:
                body = resume.first_body(body)
            tries = _tries(ranked, max_attempts)
            attempt = -1
            while (attempt := attempt + 1) < len(tries):
                candidate = tries[attempt]
                if deliveries >= max_attempts:
                    break
                replica = router.replica(candidate)
                if replica is None:
                    continue  # it left the pool since the decision
                if attempt > 0:
                    if not budget.try_spend():
                        break
                    rec.retries += 1
                    if attempt != resumed_at:  # a continuation's client is waiting mid-answer
                        delay = min(retry_cfg.backoff_max_s, retry_cfg.backoff_initial_s * 2 ** (attempt - 1))
                        await asyncio.sleep(delay * (0.5 + random.random() / 2))
                if features.adapter is not None and not await router.lora.ensure(
                    replica, features.adapter, self.lora.session
                ):
                    continue  # the adapter could not be loaded there
                claim = Claim.take(replica, learned.prompt_tokens)
                if claim is None:
                    continue
                track.replica = replica
                track.attempts += 1
                with claim:
                    # Learn at decision time, not when the answer comes: concurrent requests with
                    # the same new prefix must see where the first one went.
                    router.learn(learned, replica)
                    up = tracer.upstream(replica, attempt, headers)
                    try:
                        try:
                            url = replica.url + request.path
                            resend = deliveries + 2 <= max_attempts
                            rec.sent_at = time.perf_counter()
                            opening = self.upstream.open("POST", url, body, up.headers, resend=resend)
                            kv_from = plan.prefill if handoff and guard is None else None
                            if guard is not None:
                                resp = await _beside_prefill(opening, guard)
                            elif kv_from is not None:
                                resp = await _unless_ejected(opening, kv_from)
                            else:
                                resp = await opening
                        except PrefillLost:
                            deliveries += 1
                            log.warning(
                                "request %s: prefill %s ejected before decode %s had the KV; again without"
                                " the hand-off",
                                request_id,
                                plan.prefill.name if plan.prefill is not None else "?",
                                replica.name,
                            )
                            body = plan.alone if resume is None else resume.first_body(plan.alone)
                            handoff = False
                            rec.pd = "decode_only"
                            plan.transferred()
                            # What the client is told should no attempt without the hand-off follow.
                            failure = GatewayError(
                                502, PREFILL_LOST, "upstream_error", "upstream_prefill_lost"
                            )
                            continue
                        except UpstreamError as exc:
                            deliveries += exc.sent
                            if exc.replica_fault:
                                claim.failed()
                            log.warning("request %s: replica %s failed: %s", request_id, replica.name, exc)
                            if not exc.retryable:
                                track.error = "upstream_error"
                                raise exc.gateway_error(replica.name) from None
                            failure = exc.gateway_error(replica.name)
                            continue
                        deliveries += resp.sent
                        claim.answered()  # any well-formed answer: the engine is up
                        up.responded(resp.status)
                        if resp.status == 500 and handoff and guard is None:
                            # vLLM fails a decode whose KV it could not fetch (its default
                            # kv_load_failure_policy); without the hand-off, a decode replica
                            # prefills the prompt itself.
                            refused = GatewayError(
                                500,
                                "refused",
                                body=normalize_error_body(await self._read_error(resp), resp.status),
                            )
                            log.info(
                                "request %s: decode %s failed the hand-off; again without it",
                                request_id,
                                replica.name,
                            )
                            body = plan.alone if resume is None else resume.first_body(plan.alone)
                            handoff = False
                            rec.pd = "decode_only"
                            plan.transferred()
                            continue
                        if resp.status in retry_cfg.retry_statuses or (
                            resume is not None and resume.continuing and resp.status >= 400
                        ):
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
                            route_reason(candidate, ranked) if router.policy.uses_prefix_match else None
                        )
                        track.error = "upstream_error"  # should reading a whole answer fail
                        first: Callable[[], None] | None = (
                            functools.partial(router.first_token, features, replica)
                            if router.first_token_heard()
                            else None
                        )
                        if plan.transfer:  # the decode leg's first bytes: its KV has arrived
                            first = _then(plan.transferred, first)
                        try:
                            response = await self._relay(
                                request, resp, claim, rec, req.rename, first, resume, kv_from
                            )
                        except Cut as cut:
                            assert resume is not None
                            doc = resume.continuation()
                            rec.resumed.append(f"{cut.reason}@{replica.name}")
                            # A decode replica whose KV never came is not at fault itself.
                            keep = cut.reason in HANDOFF_FAILURES
                            log.warning(
                                "request %s: answer from %s broke (%s); continuing it %s",
                                request_id,
                                replica.name,
                                cut.reason,
                                "without the hand-off" if keep else "elsewhere",
                            )
                            learned = router.features(
                                doc, req.endpoint, rec.engine_request_id, request.headers
                            )
                            # The continuation's own ranking: its prompt holds the original's.
                            others = [
                                c for c in router.rank(learned) if keep or c.replica.name != replica.name
                            ]
                            tries[attempt + 1 :] = _tries(others, max_attempts) if others else []
                            if plan.pending:
                                await plan.finish()
                            plan = await self._continuation_plan(
                                router,
                                [] if keep else prefills,
                                learned,
                                doc,
                                others[:1],
                                request.path,
                                headers,
                            )
                            if keep:
                                rec.pd = "decode_only"
                            body, guard = plan.body, plan.guard
                            handoff = body is not plan.alone
                            resumed_at, deliveries, refused, failure = attempt + 1, 0, None, None
                            continue
                        # Not when a PD hand-off's prefill ran elsewhere, nor for a continued answer
                        # (its times span two attempts).
                        if not handoff and not rec.resumed:
                            measure_speed(replica, rec, features.prompt_tokens - candidate.matched_tokens)
                        return response
                    finally:
                        up.end(rec)
        finally:
            if plan.pending:
                await plan.finish()
        if resume is not None and resume.out is not None:
            # The answer began and no replica could go on with it: the client learns why its last
            # attempt broke, as it would have without failover.
            track.error = "upstream_error"
            rec.error_code = "upstream_stream_error"
            await resume.out.write(
                resume.error_event
                or sse_error_event("no replica could continue the answer", "upstream_stream_error")
            )
            await resume.out.write_eof()
            return resume.out
        if resume is not None and resume.continuing:
            track.error = "upstream_error"
            raise GatewayError(
                502, "no replica could continue the answer", "upstream_error", "upstream_resume_failed"
            )
        if refused is not None:
            track.error = "engine_error"
            raise refused
        if failure is not None:
            track.error = "upstream_error"
            raise failure
        track.error = "no_replica"
        raise self._no_replica(f"no replica of pool `{pool.name}` accepted the request")

    def _resume(self, request: Exchange, req: InferenceRequest) -> Resume | None:
        """The answer's continuation state when its pool continues answers like it, else None."""
        pool = req.router.pool
        cfg = pool.cfg.failover
        if not resumable(req.endpoint, req.body, request.headers, cfg):
            return None
        count = (req.router.tokenizer or get_tokenizer()).count
        return Resume(req.endpoint, req.body, cfg, count, self.upstream.cfg.max_response_bytes)

    async def _continuation_plan(
        self,
        router: PoolRouter,
        prefills: list[Candidate],
        features: RequestFeatures,
        doc: dict[str, Any],
        decode: list[Candidate],
        path: str,
        headers: Mapping[str, str],
    ) -> DecodePlan:
        """How a continuation goes out: through a fresh prefill/decode hand-off when the decode
        replica it goes to lacks enough of its prompt (PD pools), else whole to that replica."""
        body = orjson.dumps(doc)
        if not prefills or not decode or self.pd.skip(router.pool, features, decode[0]) is not None:
            return DecodePlan(body, body)
        try:
            return await self.pd.prepare(router, features, prefills, doc, body, path, headers)
        except GatewayError:  # a prefill leg that refuses it: the decode replica does it all
            return DecodePlan(body, body)

    def _no_replica(self, message: str) -> GatewayError:
        retry_after = str(self.retry_after_s)
        return GatewayError(
            503, message, "service_unavailable", "no_healthy_replica", headers={"Retry-After": retry_after}
        )

    async def _read_error(self, resp: Response) -> bytes:
        try:
            return await self.upstream.read_content(resp, ERROR_BODY_LIMIT)
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
        request: Exchange,
        resp: Response,
        claim: Claim,
        rec: RequestRecord,
        rename: ModelRename | None,
        first: Callable[[], None] | None,
        resume: Resume | None = None,
        kv_from: Replica | None = None,
    ) -> Reply | StreamOut:
        """Relay the engine's answer; `first` is called once at a streamed answer's first bytes;
        `resume`, when the answer may be continued elsewhere, follows it (raising `Cut`);
        `kv_from`, a hand-off's prefill replica, ends the wait for the first byte if ejected."""
        rec.status = resp.status
        if resp.status >= 400:
            # Rewritten in the OpenAI form, decoded: the engine's Content-Encoding no longer applies.
            headers = self._response_headers(resp, claim.replica, rec.request_id, _DROP_REWRITTEN)
            raw = await self._read_error(resp)
            headers["Content-Type"] = "application/json"
            return Reply(resp.status, normalize_error_body(raw, resp.status), headers)
        headers = self._response_headers(resp, claim.replica, rec.request_id)
        if not resp.content_type.startswith("text/event-stream"):
            try:
                raw = await self.upstream.read(resp)
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
        if resume is not None:
            return await relay_resumable(
                self.upstream, request, resp, headers, claim, rec, rename, first, resume, kv_from
            )
        return await self._relay_stream(request, resp, headers, claim, rec, rename, first, kv_from)

    async def _relay_stream(
        self,
        request: Exchange,
        resp: Response,
        headers: dict[str, str],
        claim: Claim,
        rec: RequestRecord,
        rename: ModelRename | None,
        first: Callable[[], None] | None,
        kv_from: Replica | None,
    ) -> Reply | StreamOut:
        out: StreamOut | None = None
        finished = False
        events = EventStream(rename)
        end = StreamEnd(rec.endpoint)
        lost: list[str] = []
        watch = PrefillWatch(kv_from, resp, lost)
        try:
            out = await request.stream(resp.status, headers)
            try:
                async for chunk in self.upstream.chunks(resp):
                    if rec.first_byte_at is None:
                        watch.heard = True
                        rec.first_byte_at = time.perf_counter()
                        if first is not None:
                            first()
                    chunk = events.feed(chunk)
                    if not chunk:
                        continue
                    if USAGE_MARK in chunk:
                        read_usage(chunk, rec)
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
                message = PREFILL_LOST if lost else exc.client_message(claim.replica.name)
                await out.write(sse_error_event(message, "upstream_stream_error"))
            await out.write_eof()
            finished = True
        except ConnectionResetError:
            client_left(end, rec)
        finally:
            watch.close()
            if finished:
                resp.release()
            else:
                rec.completed = end.complete  # read by `handle` if this is a cancellation
                # The client left (or we were cancelled): drop the upstream connection so the
                # engine aborts the request instead of generating for nobody.
                resp.close()
        # Gone before the status line was sent: nobody reads this.
        return out if out is not None else Reply(499)


class _Track:
    """Where a request went and why it failed, for the policy's completion hook."""

    __slots__ = ("attempts", "error", "prefill", "replica", "status")

    def __init__(self) -> None:
        self.replica: Replica | None = None  # the (decode) replica that last took it
        self.prefill: str | None = None
        self.attempts = 0
        self.status = 0
        self.error: str | None = "gateway_error"  # until the request's path says otherwise

    def outcome(self, rec: RequestRecord, features: RequestFeatures) -> Outcome:
        return Outcome(
            ok=self.error is None,
            status=self.status or rec.status or None,
            error=self.error,
            ttft_s=rec.ttft_s,
            e2e_s=time.perf_counter() - rec.started,
            prompt_tokens=rec.engine_prompt_tokens or features.prompt_tokens,
            cached_tokens=rec.engine_cached_tokens,
            attempts=self.attempts,
            prefill_replica=self.prefill,
        )


def measure_speed(replica: Replica, rec: RequestRecord, believed_uncached: int) -> None:
    """A completed answer teaches the replica's measured speed. Uncached tokens are the engine's
    own figures where its usage gives them, else what the routing decision believed."""
    if rec.sent_at is None or rec.first_byte_at is None or rec.status != 200 or rec.error_code is not None:
        return
    if rec.client_disconnected:
        return
    uncached = believed_uncached
    if rec.engine_prompt_tokens is not None and rec.engine_cached_tokens is not None:
        uncached = rec.engine_prompt_tokens - rec.engine_cached_tokens
    output = rec.engine_output_tokens or 0
    replica.speed.observe(rec.sent_at, rec.first_byte_at, time.perf_counter(), max(0, uncached), output)


def route_reason(chosen: Candidate, ranked: list[Candidate]) -> str:
    """How a prefix-aware choice relates to the cache: `cold` when no replica held any of the
    prompt, `cache_hit` when the chosen one held the most, `spill` when a warmer one was passed
    over (its queue made it slower, or it failed)."""
    best = max(c.matched_tokens for c in ranked)
    if best == 0:
        return "cold"
    return "cache_hit" if chosen.matched_tokens == best else "spill"


def _then(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    if then is None:
        return first

    def both() -> None:
        first()
        then()

    return both


def _tries(ranked: list[Candidate], attempts: int) -> list[Candidate]:
    """The replicas to try, best first, wrapping around when there are fewer than attempts."""
    return ranked[:attempts] if len(ranked) >= attempts else (ranked * attempts)[:attempts]


async def _beside_prefill(opening: Coroutine[Any, Any, Response], guard: asyncio.Task[None]) -> Response:
    """Open the decode leg beside a concurrent prefill leg (`guard`): fail fast if that leg breaks
    first."""
    decode = asyncio.ensure_future(opening)
    try:
        await asyncio.wait({decode, guard}, return_when=asyncio.FIRST_COMPLETED)
        if not decode.done() and guard.exception() is not None:
            # The decode replica is not at fault: its bootstrap partner went away.
            raise UpstreamError(
                f"prefill leg failed: {guard.exception()}",
                code="upstream_prefill_failed",
                replica_fault=False,
                public="its prefill leg failed",
            )
        return await decode
    except BaseException:
        await _abandon(decode)
        raise


class PrefillLost(Exception):
    """A hand-off's prefill replica was ejected before its decode leg answered."""


async def _unless_ejected(opening: Coroutine[Any, Any, Response], prefill: Replica) -> Response:
    """Open a decode leg that takes its KV from `prefill`. vLLM's decode replica waits on that
    fetch without a deadline (a hung prefill replica held a request until its client gave up, on
    the H200): should `prefill` be ejected by its health checks first, stop waiting."""
    if not prefill.healthy:  # ejected between its answer and now
        opening.close()
        raise PrefillLost
    decode = asyncio.ensure_future(opening)
    lost = asyncio.get_running_loop().create_future()

    def ejected() -> None:
        if not lost.done():
            lost.set_result(None)

    prefill.on_eject.add(ejected)
    try:
        await asyncio.wait({decode, lost}, return_when=asyncio.FIRST_COMPLETED)
        if not decode.done():
            raise PrefillLost
        return await decode
    except BaseException:
        await _abandon(decode)
        raise
    finally:
        prefill.on_eject.discard(ejected)
        lost.cancel()


async def _abandon(opening: asyncio.Future[Response]) -> None:
    """Stop an opening nobody will read; an answer that arrived anyway is closed, not leaked."""
    opening.cancel()
    await asyncio.gather(opening, return_exceptions=True)
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _retry_after(resp: Response) -> dict[str, str]:
    value = resp.header("Retry-After")
    return {"Retry-After": value} if value else {}
