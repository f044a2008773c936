"""One request in named steps: prepare -> admit -> decide -> attempts -> relay.

`handle` takes a client's request whose body was read: the preparation step makes the request
object (gateway/path/prepare.py), the scheduler admits it, the pool's router makes its routing
`Decision`, and the attempts walk it (gateway/path/attempts.py), each relaying its answer
(gateway/path/relay.py) or handing the next step to another replica: retries before the first
byte, a prefill/decode hand-off's fallbacks (gateway/path/handoff.py), the continuation of a
broken answer (gateway/path/resume.py).

Every request ends in exactly one of: the engine's answer relayed byte-for-byte but for the
model's name (the client's, not the engine's: gateway/path/model_names.py), or an OpenAI-style
error. Load taken on a replica is released exactly once, whether the request succeeds, fails,
times out or the client goes away; and the pool's policy hears how each request it ranked ended
(`Decision.ended`), exactly once too.
"""

from __future__ import annotations

import asyncio
import time

from gateway.admission.scheduler import Scheduler
from gateway.config import RetryConfig
from gateway.errors import GatewayError
from gateway.path.attempts import Attempts, Dispatch
from gateway.path.exchange import Exchange, Reply, StreamOut
from gateway.path.handoff import HandOff
from gateway.path.prepare import Preparation
from gateway.path.request_record import RequestRecord
from gateway.path.retry_budget import RetryBudget
from gateway.path.trace import Tracer
from gateway.path.upstream import Upstream
from gateway.routing.lora import LoraWatch


class Proxy:
    """The request path after the body was read."""

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
        self.preparation = preparation
        self.scheduler = scheduler
        self.tracer = tracer
        handoff = HandOff(upstream, resend=retry.max_attempts >= 2)
        self.dispatch = Dispatch(retry, retry_after_s, upstream, retry_budget, tracer, lora, handoff)

    async def handle(
        self, request: Exchange, raw: bytes, tenant: str | None, rec: RequestRecord
    ) -> Reply | StreamOut:
        """A client's request, its body read and its tenant known: prepare, admit, decide, attempt."""
        req = await self.preparation.prepare(request.path, request.headers, raw, tenant, rec)
        queued_at = time.perf_counter()
        with self.tracer.span("queue", {"kvgate.priority_class": req.features.priority_class}):
            ticket = await self.scheduler.admit(req.router, req.features)
        rec.queued_s = time.perf_counter() - queued_at
        with ticket:
            with self.tracer.span("route", {"kvgate.policy": req.router.pool.cfg.policy.type}):
                decision = req.router.route(req.features)
            # From here the policy has decided: it hears how the request ended, exactly once, on
            # every path (an answer, an error, a retry's end, the client leaving, cancellation).
            attempts = Attempts(self.dispatch, request, req, decision)
            status, error = 0, attempts.error
            try:
                response = await attempts.run()
            except asyncio.CancelledError:
                # A client that closes after the end of its stream got its answer.
                error = None if rec.completed else "client_disconnected"
                raise
            except GatewayError as exc:
                status, error = exc.status, attempts.error
                raise
            else:
                status, error = rec.status, _error_kind(rec)
                return response
            finally:
                decision.ended(
                    status or rec.status or None,
                    error,
                    rec.ttft_s,
                    time.perf_counter() - rec.started,
                    rec.engine_prompt_tokens,
                    rec.engine_cached_tokens,
                )


def _error_kind(rec: RequestRecord) -> str | None:
    """How a request whose answer was relayed ended, as its policy hears it."""
    if rec.status >= 400:
        return "engine_error"
    if rec.client_disconnected:
        return "client_disconnected"
    return "upstream_error" if rec.error_code is not None else None
