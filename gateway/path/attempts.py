"""The attempts at one request: its routing decision walked, one attempt at a time, until an answer.

Each attempt takes a candidate (retries wrap around a short ranking), claims it, sends the request
(its decode leg, in a prefill/decode pool) and ends in one outcome value; one `match` decides the
next step:

  Answered   the answer was relayed: done
  Refused    a retryable status (or any error while continuing an answer): the next candidate;
             relayed as it came should every other try fail
  Failed     a transport failure before the first byte: the next candidate
  Unfetched  a hand-off's KV did not come (its prefill replica lost, the decode replica could not
             fetch it): again without the hand-off
  Broken     the answer broke after it began and can be continued: the continuation is ranked on
             its own prompt and sent to the best replica but the one that broke
  Skipped    the candidate could not be tried (gone, its circuit open, its adapter not loaded)
  Fatal      a failure no other replica may repeat (the engine may have started generating): the
             client is told, in the stream it already has when the answer began

Generation is not idempotent: a request reaches engines at most `retry.max_attempts` times in all
(deliveries, a stale keep-alive connection's silent resend included); retries spend the retry
budget and back off, but for a continuation, whose client waits mid-answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config import RetryConfig
from gateway.errors import GatewayError, normalize_error_body
from gateway.fleet.replica import Replica
from gateway.path.claim import Claim
from gateway.path.exchange import Exchange, Reply, StreamOut
from gateway.path.handoff import PREFILL_LOST, DecodePlan, HandOff, PrefillLost
from gateway.path.relay import HANDOFF_FAILURES, Cut, read_error, relay
from gateway.path.request import InferenceRequest
from gateway.path.request_record import RequestRecord
from gateway.path.resume import Resume, resumable
from gateway.path.retry_budget import ContinuationBudget, RetryBudget
from gateway.path.sanitize import upstream_headers
from gateway.path.sse_events import sse_error_event
from gateway.path.trace import AttemptSpan, Tracer
from gateway.path.transports.base import Response
from gateway.path.upstream import Upstream, UpstreamError
from gateway.routing.decision import Decision
from gateway.routing.lora import LoraWatch
from gateway.routing.policy import Candidate

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What every request's attempts share."""

    retry: RetryConfig
    retry_after_s: float  # what a 503 for want of replicas tells the client
    upstream: Upstream
    budget: RetryBudget
    tracer: Tracer
    lora: LoraWatch  # loads LoRA adapters onto replicas on demand
    handoff: HandOff
    continuations: dict[str, ContinuationBudget] = field(default_factory=dict)  # by pool

    def may_continue(self, req: InferenceRequest) -> bool:
        """Whether the pool's continuation budget allows one more, with its requests in flight now."""
        pool = req.router.pool
        budget = self.continuations.get(pool.name)
        if budget is None:
            budget = self.continuations[pool.name] = ContinuationBudget()
        budget.ratio = pool.cfg.failover.budget_ratio  # as a reload may have set it
        return budget.try_spend(sum(r.inflight_requests for r in pool.replicas.values()))


@dataclass(frozen=True, slots=True)
class Answered:
    response: Reply | StreamOut


@dataclass(frozen=True, slots=True)
class Refused:
    error: GatewayError


@dataclass(frozen=True, slots=True)
class Failed:
    error: GatewayError


@dataclass(frozen=True, slots=True)
class Unfetched:
    refused: GatewayError | None  # the decode replica's own answer, when it gave one


@dataclass(frozen=True, slots=True)
class Broken:
    cut: Cut
    replica: Replica


@dataclass(frozen=True, slots=True)
class Skipped:
    pass


@dataclass(frozen=True, slots=True)
class Fatal:
    error: GatewayError


Outcome = Answered | Refused | Failed | Unfetched | Broken | Skipped | Fatal
SKIPPED = Skipped()


def _tries(ranked: list[Candidate], attempts: int) -> list[Candidate]:
    """The replicas to try, best first, wrapping around when there are fewer than attempts."""
    return ranked[:attempts] if len(ranked) >= attempts else (ranked * attempts)[:attempts]


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


def _retry_after(resp: Response) -> dict[str, str]:
    value = resp.header("Retry-After")
    return {"Retry-After": value} if value else {}


class Attempts:
    def __init__(
        self, dispatch: Dispatch, request: Exchange, req: InferenceRequest, decision: Decision
    ) -> None:
        self.dispatch = dispatch
        self.request = request
        self.req = req
        self.rec = req.record
        self.decision = decision
        self.learned = decision.features  # what the replica taking the request is taught it holds
        self.headers = upstream_headers(
            request.headers.items(), decision.router.pool.passthrough_headers, self.rec.engine_request_id
        )
        raw = req.payload()
        self.plan = DecodePlan(raw, raw)
        self.resume = _resume(dispatch, request, req)
        self.body = raw  # what the next attempt sends
        self.tries: list[Candidate] = []
        self.attempt = -1
        self.resumed_at = -1  # the attempt that first continues the answer (no backoff before it)
        self.cut: str | None = None  # "<reason>@<replica>" of a continuation not sent yet
        self.deliveries = 0
        self.refused: GatewayError | None = None  # the last retryable answer, relayed if every try fails
        self.failure: GatewayError | None = None  # the last retryable transport failure
        self.error: str | None = "gateway_error"  # the Outcome's kind, should the request fail

    async def run(self) -> Reply | StreamOut:
        if not self.decision.ranked:
            self.error = "no_replica"
            raise self._no_replica(f"no healthy replica in pool `{self.decision.pool}`")
        self.dispatch.budget.on_request()
        try:
            await self._first_plan()
            self.tries = _tries(self.decision.ranked, self.dispatch.retry.max_attempts)
            while (turn := await self._next()) is not None:
                match await self._attempt(*turn):
                    case Answered(response):
                        return response
                    case Refused(error):
                        self.refused = error
                    case Failed(error):
                        self.failure = error
                    case Unfetched(refused):
                        self._without_handoff(refused)
                    case Broken(cut, replica):
                        await self._continue(cut, replica)
                    case Skipped():
                        pass
                    case Fatal(error):
                        return await self._fail(error)
        finally:
            if self.plan.pending:
                await self.plan.finish()
        return await self._exhausted()

    # -- the plan: with a hand-off or without --------------------------------------------------
    async def _first_plan(self) -> None:
        decision, rec, handoff = self.decision, self.rec, self.dispatch.handoff
        if not decision.prefills:
            self._set_plan(self.plan)
            return
        skip = handoff.skip(decision.router.pool, decision.features, decision.ranked[0])
        if skip is not None:
            rec.pd = skip
            self._set_plan(self.plan)
            return
        req = self.req
        try:
            plan = await handoff.prepare(
                decision, decision.features, req.body, self.plan.alone, req.path, self.headers
            )
        except GatewayError:
            self.error = "engine_error"  # the prefill leg's refusal is the client's answer
            raise
        decision.prefill = plan.prefill.name if plan.prefill is not None else None
        rec.pd = "handoff" if plan.handoff else "decode_only"
        self._set_plan(plan)

    def _set_plan(self, plan: DecodePlan) -> None:
        self.plan = plan
        resume = self.resume
        self.body = resume.first_body(plan.body) if resume is not None else plan.body

    def _without_handoff(self, refused: GatewayError | None) -> None:
        """The KV will not come: the decode replicas serve the request whole from now on."""
        self.plan.drop()
        self._set_plan(self.plan)
        self.rec.pd = "decode_only"
        if refused is not None:
            self.refused = refused
        else:  # what the client is told should no attempt without the hand-off follow
            self.failure = GatewayError(502, PREFILL_LOST, "upstream_error", "upstream_prefill_lost")

    # -- one attempt --------------------------------------------------------------------------
    async def _next(self) -> tuple[int, Candidate, Replica] | None:
        """The next attempt's candidate, once the budget allows and its backoff has passed."""
        retry = self.dispatch.retry
        while (attempt := self.attempt + 1) < len(self.tries):
            self.attempt = attempt
            if self.deliveries >= retry.max_attempts:
                return None
            candidate = self.tries[attempt]
            replica = self.decision.replica_of(candidate)
            if replica is None:
                continue  # it left the pool since the decision
            if attempt > 0:
                # A continuation spends the pool's continuation budget, any other try the retry budget.
                if attempt == self.resumed_at:
                    if not self.dispatch.may_continue(self.req):
                        log.warning(
                            "request %s: the pool's continuation budget is spent", self.rec.request_id
                        )
                        return None
                elif not self.dispatch.budget.try_spend():
                    return None
                self.rec.retries += 1
                if attempt != self.resumed_at:  # a continuation's client is waiting mid-answer
                    delay = min(retry.backoff_max_s, retry.backoff_initial_s * 2 ** (attempt - 1))
                    await asyncio.sleep(delay * (0.5 + random.random() / 2))
            return attempt, candidate, replica
        return None

    async def _attempt(self, attempt: int, candidate: Candidate, replica: Replica) -> Outcome:
        adapter = self.learned.adapter
        lora = self.req.router.lora
        if adapter is not None and not await lora.ensure(replica, adapter, self.dispatch.lora.session):
            return SKIPPED  # the adapter could not be loaded there
        claim = Claim.take(replica, self.learned.prompt_tokens)
        if claim is None:
            return SKIPPED
        with claim:
            # Learn at decision time, not when the answer comes: concurrent requests with the
            # same new prefix must see where the first one went.
            self.decision.sent(replica, self.learned)
            if self.cut is not None:  # the continuation goes out: now it counts as one
                self.rec.resumed.append(self.cut)
                self.cut = None
            span = self.dispatch.tracer.upstream(replica, attempt, self.headers)
            try:
                return await self._exchange(candidate, replica, claim, span)
            finally:
                span.end(self.rec)

    async def _exchange(
        self, candidate: Candidate, replica: Replica, claim: Claim, span: AttemptSpan
    ) -> Outcome:
        dispatch, rec, plan = self.dispatch, self.rec, self.plan
        try:
            resend = self.deliveries + 2 <= dispatch.retry.max_attempts
            rec.sent_at = time.perf_counter()
            url = replica.url + self.request.path
            resp = await plan.open(
                dispatch.upstream.open("POST", url, self.body, span.headers, resend=resend)
            )
        except PrefillLost:
            self.deliveries += 1
            prefill = plan.prefill.name if plan.prefill is not None else "?"
            log.warning(
                "request %s: prefill %s ejected before decode %s had the KV; again without the hand-off",
                rec.request_id,
                prefill,
                replica.name,
            )
            return Unfetched(None)
        except UpstreamError as exc:
            self.deliveries += exc.sent
            rec.resent += max(0, exc.sent - 1)
            if exc.replica_fault:
                claim.failed()
            log.warning("request %s: replica %s failed: %s", rec.request_id, replica.name, exc)
            if not exc.retryable:
                return Fatal(exc.gateway_error(replica.name))
            return Failed(exc.gateway_error(replica.name))
        self.deliveries += resp.sent
        rec.resent += resp.sent - 1
        claim.answered()  # any well-formed answer: the engine is up
        span.responded(resp.status)
        connector = plan.connector
        if (
            plan.handoff
            and plan.guard is None
            and connector is not None
            and connector.kv_fetch_failed(resp.status)
        ):
            body = normalize_error_body(await read_error(dispatch.upstream, resp), resp.status)
            log.info(
                "request %s: decode %s failed the hand-off; again without it", rec.request_id, replica.name
            )
            return Unfetched(GatewayError(resp.status, "refused", body=body))
        resume = self.resume
        if resp.status in dispatch.retry.retry_statuses or (
            resume is not None and resume.continuing and resp.status >= 400
        ):
            body = normalize_error_body(await read_error(dispatch.upstream, resp), resp.status)
            log.info("request %s: replica %s answered %d", rec.request_id, replica.name, resp.status)
            return Refused(GatewayError(resp.status, "refused", headers=_retry_after(resp), body=body))
        return await self._relay(candidate, replica, claim, resp)

    async def _relay(self, candidate: Candidate, replica: Replica, claim: Claim, resp: Response) -> Outcome:
        rec, plan = self.rec, self.plan
        rec.replica = replica.name
        rec.matched_tokens = candidate.matched_tokens
        rec.cpu_matched_tokens = candidate.cpu_matched_tokens
        rec.route_reason = self.decision.reason(candidate)
        self.error = "upstream_error"  # should reading a whole answer fail
        try:
            response = await relay(
                self.dispatch.upstream,
                self.request,
                resp,
                claim,
                rec,
                self.req.rename,
                self._first_bytes(replica),
                self.resume,
                plan.kv_from,
            )
        except Cut as cut:
            return Broken(cut, replica)
        # Not when a hand-off's prefill ran elsewhere, nor for a continued answer (its times span
        # two attempts).
        if not plan.handoff and not rec.resumed:
            measure_speed(replica, rec, self.decision.features.prompt_tokens - candidate.matched_tokens)
        return Answered(response)

    def _first_bytes(self, replica: Replica) -> Callable[[], None] | None:
        """What an answer's first bytes settle: the hand-off's KV is no longer in transfer, and the
        policy hears of its first token."""
        plan, decision = self.plan, self.decision
        transfer, heard = plan.transfer > 0, decision.hears_first_token
        if not transfer and not heard:
            return None

        def first() -> None:
            if transfer:
                plan.transferred()
            if heard:
                decision.first_token(replica)

        return first

    # -- a continuation -----------------------------------------------------------------------
    async def _continue(self, cut: Cut, replica: Replica) -> None:
        """Send the continuation of a broken answer to the best other replica (to the same one,
        without the hand-off, when only the hand-off's KV failed it)."""
        resume, rec = self.resume, self.rec
        assert resume is not None
        doc = resume.continuation()
        self.cut = f"{cut.reason}@{replica.name}"
        keep = cut.reason in HANDOFF_FAILURES  # a decode replica whose KV never came is not at fault
        req = self.req
        self.learned, others = self.decision.rerank(
            doc, req.endpoint, self.request.headers, None if keep else replica.name
        )
        log.warning(
            "request %s: answer from %s broke (%s); %s",
            rec.request_id,
            replica.name,
            cut.reason,
            "no other replica to continue it"
            if not others
            else "continuing it without the hand-off"
            if keep
            else "continuing it elsewhere",
        )
        max_attempts = self.dispatch.retry.max_attempts
        self.tries[self.attempt + 1 :] = _tries(others, max_attempts) if others else []
        if self.plan.pending:
            await self.plan.finish()
        self.plan = await self._continuation_plan(doc, others[:1], not keep)
        self.body = self.plan.body
        if keep:
            rec.pd = "decode_only"
        self.resumed_at, self.deliveries, self.refused, self.failure = self.attempt + 1, 0, None, None

    async def _continuation_plan(
        self, doc: dict[str, Any], decode: list[Candidate], handoff: bool
    ) -> DecodePlan:
        """How a continuation goes out: through a fresh hand-off when the decode replica it goes to
        lacks enough of its prompt (prefill/decode pools), else whole to that replica."""
        body = orjson.dumps(doc)
        decision, handoffs = self.decision, self.dispatch.handoff
        if not handoff or not decision.prefills or not decode:
            return DecodePlan(body, body)
        if handoffs.skip(decision.router.pool, self.learned, decode[0]) is not None:
            return DecodePlan(body, body)
        try:
            return await handoffs.prepare(decision, self.learned, doc, body, self.request.path, self.headers)
        except GatewayError:  # a prefill leg that refuses it: the decode replica does it all
            return DecodePlan(body, body)

    # -- every try failed ---------------------------------------------------------------------
    async def _fail(self, error: GatewayError) -> StreamOut:
        """A failure that ends the request: raised, or, where the client's stream is open (a
        continuation's attempt), told in it as an error event."""
        self.error = "upstream_error"
        resume = self.resume
        if resume is None or resume.out is None:
            raise error
        self.rec.error_code = "upstream_stream_error"
        await resume.out.write(sse_error_event(error.message, "upstream_stream_error"))
        await resume.out.write_eof()
        return resume.out

    async def _exhausted(self) -> Reply | StreamOut:
        resume, rec = self.resume, self.rec
        if resume is not None and resume.out is not None:
            # The answer began and no replica could go on with it: the client learns why its last
            # attempt broke, as it would have without failover.
            self.error = "upstream_error"
            rec.error_code = "upstream_stream_error"
            await resume.out.write(
                resume.error_event
                or sse_error_event("no replica could continue the answer", "upstream_stream_error")
            )
            await resume.out.write_eof()
            return resume.out
        if resume is not None and resume.continuing:
            self.error = "upstream_error"
            raise GatewayError(
                502, "no replica could continue the answer", "upstream_error", "upstream_resume_failed"
            )
        if self.refused is not None:
            self.error = "engine_error"
            raise self.refused
        if self.failure is not None:
            self.error = "upstream_error"
            raise self.failure
        self.error = "no_replica"
        raise self._no_replica(f"no replica of pool `{self.decision.pool}` accepted the request")

    def _no_replica(self, message: str) -> GatewayError:
        retry_after = {"Retry-After": str(self.dispatch.retry_after_s)}
        return GatewayError(503, message, "service_unavailable", "no_healthy_replica", headers=retry_after)


def _resume(dispatch: Dispatch, request: Exchange, req: InferenceRequest) -> Resume | None:
    """The answer's continuation state when its pool continues answers like it, else None."""
    router = req.router
    pool = router.pool
    engine = pool.dialect
    if engine is None or not engine.continues:
        return None
    if not resumable(req.endpoint, req.body, request.headers, pool.cfg.failover):
        return None
    limit = dispatch.upstream.cfg.max_response_bytes
    return Resume(req.endpoint, req.body, pool.cfg.failover, router.count, limit, engine.continuation)
