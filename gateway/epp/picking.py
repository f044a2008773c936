"""What the Endpoint Picker decides, and what it learns from the answer: the one module of EPP mode
that uses the request path's preparation, admission and routing.

The ext_proc server (gateway/epp/processor.py) calls `Picker.pick` once a request's headers and
body are read, and the returned `Pick`'s hooks as the answer comes back through Envoy:

    pick = await picker.pick(headers, body, subset)   # Pick, or Refusal (Envoy answers it)
    answer_headers = pick.served(endpoint, status)    # the endpoint Envoy reports it used
    pick.first_token()                                # a streamed answer's first bytes
    pick.ended(status, usage, error)                  # exactly once, whatever ends the request

A Pick holds what the proxy holds for one request: the admission ticket, the chosen replica's claim
(its load and breaker admission), and the routing `Decision` whose `ended` is owed exactly once.
`Pick.ended` settles all of them and is idempotent; the server calls it on every path (answer,
error, client gone, stream reset, shutdown). The decision is the proxy's (gateway/path/proxy.py):
the same preparation, admission and `PoolRouter.route` (a prefill/decode pool's decode leg), and
the same hooks (`Decision.sent` at decision time, the first token, the end); Envoy carries the
bytes, so the fallback list stands for the proxy's retries and the served endpoint for the replica
that took the attempt.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.admission.limits import ShedError
from gateway.admission.scheduler import Scheduler, Ticket
from gateway.config import EppConfig, RetryConfig
from gateway.errors import GatewayError, client_error, error_body
from gateway.fleet.breaker import Admission
from gateway.fleet.engines import CONTROL_HEADER_PREFIXES, CONTROL_HEADERS
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.path.attempts import measure_speed
from gateway.path.claim import Claim
from gateway.path.model_names import ModelRename
from gateway.path.prepare import Preparation
from gateway.path.request import InferenceRequest
from gateway.path.request_record import RequestRecord, read_usage
from gateway.path.sanitize import client_request_id, new_request_id
from gateway.prompt.endpoints import PATHS
from gateway.routing.decision import Decision
from gateway.routing.lora import LoraWatch
from gateway.routing.policy import Candidate

log = logging.getLogger(__name__)

# Headers of the Gateway API Inference Extension: read here, never forwarded to engines.
OBJECTIVE = "x-gateway-inference-objective"
FAIRNESS_ID = "x-gateway-inference-fairness-id"
ROUTING_HINTS = (
    OBJECTIVE,
    FAIRNESS_ID,
    "x-gateway-destination-endpoint-subset",
    "x-gateway-model-name-rewrite",
)


@dataclass(slots=True)
class Refusal:
    """An answer the EPP gives instead of a destination (Envoy's ImmediateResponse): an error in
    the OpenAI form, with its status and headers (Retry-After where the client may retry)."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, exc: GatewayError, request_id: str | None = None) -> Refusal:
        headers = dict(exc.headers)
        if request_id is not None:
            headers["x-request-id"] = request_id
        return cls(exc.status, exc.body(), headers)


def address(url: str) -> str:
    """A replica's `ip:port` as an EPP names it (`[v6]:port` for IPv6): the endpoint Envoy connects to."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Pick:
    """One request's decision and what is owed for it until `ended`. `endpoints` is the fallback
    list, best first; `body` the bytes engines get (None: the client's own); `set_headers` and
    `remove_headers` the request's header mutation; `rename` the answer's model name."""

    __slots__ = (
        "_claim",
        "_decision",
        "_ended",
        "_first",
        "_observe",
        "_replica",
        "_served_by",
        "_ticket",
        "body",
        "endpoints",
        "remove_headers",
        "rename",
        "req",
        "set_headers",
    )

    def __init__(
        self,
        endpoints: list[str],
        set_headers: dict[str, str],
        remove_headers: list[str],
        observe: Callable[[RequestRecord], None],
        req: InferenceRequest | None = None,
        ticket: Ticket | None = None,
        claim: Claim | None = None,
        decision: Decision | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.set_headers = set_headers
        self.remove_headers = remove_headers
        self.req = req  # None for a request that is not an inference one (a GET): nothing to account
        self.body = req.payload() if req is not None and req.dirty else None
        self.rename: ModelRename | None = req.rename if req is not None else None
        self._observe = observe
        self._ticket = ticket
        self._claim = claim
        self._decision = decision
        self._replica = claim.replica if claim is not None else None
        self._served_by: Replica | None = None
        self._first = False
        self._ended = False

    def served(self, endpoint: str | None, status: int) -> dict[str, str]:
        """The gateway's answer began (`status`), from `endpoint` (Envoy's served-endpoint report;
        None when it gave none): its load and what it learned move there when it is not the first
        of the list. The headers to add to the answer."""
        req, claim, decision = self.req, self._claim, self._decision
        if req is None or claim is None or decision is None or self._served_by is not None:
            return {}
        rec, router = req.record, req.router
        rec.status = status
        first = claim.replica
        replica = first
        if endpoint is not None and endpoint != address(first.url):
            other = next((r for r in router.pool.replicas.values() if address(r.url) == endpoint), None)
            if other is not None:
                # Envoy went past the first endpoint: it failed to answer (connect failure, reset).
                claim.failed()
                claim.close()
                rec.retries += 1
                claim = self._claim = Claim.take(other, req.features.prompt_tokens) or Claim(
                    other, Admission.ADMITTED, req.features.prompt_tokens
                )
                decision.sent(other)
                replica = other
        elif endpoint is None and status >= 500:
            claim.failed()  # Envoy's own answer: no endpoint of the list took the request
            self._served_by = first
            return {"x-request-id": rec.request_id}
        claim.answered()
        self._served_by = replica
        rec.replica = replica.name
        candidate = _candidate(decision, replica)
        if candidate is not None:
            rec.matched_tokens = candidate.matched_tokens
            rec.cpu_matched_tokens = candidate.cpu_matched_tokens
            rec.route_reason = decision.reason(candidate)
        return {
            "x-request-id": rec.request_id,
            "x-kvgate-replica": replica.name,
            "x-kvgate-pool": replica.pool,
        }

    def first_token(self) -> None:
        """A streamed answer's first bytes went to the client."""
        req, decision = self.req, self._decision
        if req is None or self._first:
            return
        self._first = True
        req.record.first_byte_at = time.perf_counter()
        replica = self._served_by or self._replica
        if replica is not None and decision is not None and decision.hears_first_token:
            decision.first_token(replica)

    def ended(self, status: int, usage: bytes | None, error: str | None) -> None:
        """The request is over: `status` the client got (0: none), `usage` the answer's bytes that
        hold the engine's usage figures (its JSON body, or the SSE event with them), `error` None
        for an answer relayed whole, else the Outcome's kind (`client_disconnected`,
        `upstream_error`, `engine_error`, `gateway_error`). Settles the ticket, the replica's load
        and the policy's completion hook; once, whatever calls it again."""
        if self._ended:
            return
        self._ended = True
        req = self.req
        try:
            if req is None:
                return
            rec, features, decision = req.record, req.features, self._decision
            rec.status = status or rec.status
            if usage is not None:
                read_usage(usage, rec)
            if status >= 400 and error is None:
                error = "engine_error"
            if error == "client_disconnected":
                rec.client_disconnected = True
            elif error is not None:
                rec.error_code = rec.error_code or error
            replica = self._served_by
            if replica is not None and error is None and rec.first_byte_at is None:
                rec.first_byte_at = time.perf_counter()  # a whole JSON answer: its bytes came at once
            if replica is not None and error is None and not rec.resumed and decision is not None:
                candidate = _candidate(decision, replica)
                matched = candidate.matched_tokens if candidate is not None else 0
                measure_speed(replica, rec, features.prompt_tokens - matched)
            if decision is not None:
                decision.ended(
                    status or None,
                    error,
                    rec.ttft_s,
                    time.perf_counter() - rec.started,
                    rec.engine_prompt_tokens,
                    rec.engine_cached_tokens,
                )
            rec.ended = time.perf_counter()
            self._observe(rec)
        finally:
            if self._claim is not None:
                self._claim.close()
            if self._ticket is not None:
                self._ticket.release()


class Picker:
    """Decides where each request goes, on the proxy's preparation, admission and routing."""

    def __init__(
        self,
        cfg: EppConfig,
        retry: RetryConfig,
        retry_after_s: float,
        preparation: Preparation,
        scheduler: Scheduler,
        pools: Mapping[str, Pool],
        lora: LoraWatch,
        observe: Callable[[RequestRecord], None],
    ) -> None:
        self.cfg = cfg
        self.fallbacks = cfg.fallback_endpoints or retry.max_attempts
        self.retry_after_s = retry_after_s
        self.preparation = preparation
        self.scheduler = scheduler
        self.pools = pools
        self.lora = lora
        self.observe = observe
        self.classes = set(scheduler.classes.levels)
        self._turn = itertools.count()  # spreads requests that are not inference ones

    async def pick(
        self, headers: Mapping[str, str], body: bytes, subset: Sequence[str] | None
    ) -> Pick | Refusal:
        """Where the request goes. `headers` are lower-case, with the pseudo-headers `:method` and
        `:path`; `body` is whole; `subset`, when the gateway sent a subset hint, the only endpoints
        allowed. Raises nothing but cancellation: every refusal is a `Refusal`."""
        path = headers.get(":path", "").partition("?")[0]
        endpoint = PATHS.get(path)
        if endpoint is None or headers.get(":method") != "POST":
            return self._any(headers, subset)
        engine_id = new_request_id()
        rec = RequestRecord(
            client_request_id(headers.get("x-request-id")) or engine_id, endpoint, engine_request_id=engine_id
        )
        try:
            return await self._route(path, self._with_priority(headers), body, rec, subset)
        except GatewayError as exc:
            rec.status, rec.error_code = exc.status, exc.code
            if isinstance(exc, ShedError):
                rec.shed_reason = exc.shed_reason
            rec.ended = time.perf_counter()
            self.observe(rec)
            return Refusal.of(exc, rec.request_id)

    def _with_priority(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """The headers with the objective's priority class as `x-priority` (see docs/epp.md)."""
        objective = headers.get(OBJECTIVE)
        if not objective:
            return headers
        name = self.cfg.objectives.get(objective, objective)
        return {**headers, "x-priority": name} if name in self.classes else headers

    async def _route(
        self,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        rec: RequestRecord,
        subset: Sequence[str] | None,
    ) -> Pick | Refusal:
        if headers.get("content-encoding", "identity").lower() != "identity":
            raise client_error(
                "a compressed request body is not accepted by the endpoint picker",
                "unsupported_content_encoding",
                status=415,
            )
        tenant = headers.get(FAIRNESS_ID) or None
        rec.tenant = tenant
        req = await self.preparation.prepare(path, headers, body, tenant, rec)
        queued_at = time.perf_counter()
        ticket = await self.scheduler.admit(req.router, req.features)
        rec.queued_s = time.perf_counter() - queued_at
        try:
            pick = await self._decide(req, ticket, subset)
        except BaseException:
            ticket.release()
            raise
        rec.sent_at = time.perf_counter()
        return pick

    async def _decide(self, req: InferenceRequest, ticket: Ticket, subset: Sequence[str] | None) -> Pick:
        # A prefill/decode pool's requests go to their decode leg whole: Envoy carries one request.
        decision = req.router.route(req.features)
        try:
            return await self._claim(req, ticket, decision, subset)
        except BaseException as exc:
            # Ranked and never sent: the policy hears it ended, as the proxy's walk tells it.
            kind = "no_replica" if isinstance(exc, GatewayError) else "gateway_error"
            status = exc.status if isinstance(exc, GatewayError) else None
            decision.ended(status, kind, None, time.perf_counter() - req.record.started, None, None)
            raise

    async def _claim(
        self, req: InferenceRequest, ticket: Ticket, decision: Decision, subset: Sequence[str] | None
    ) -> Pick:
        router, features = req.router, req.features
        pool = router.pool
        ranked = decision.ranked
        if subset is not None:
            allowed = set(subset)
            ranked = [c for c in ranked if address(c.replica.url) in allowed]
            if not ranked:
                raise self._no_replica(f"no ready replica of pool `{pool.name}` is in the gateway's subset")
        if not ranked:
            raise self._no_replica(f"no healthy replica in pool `{pool.name}`")
        # The first replica that admits the request (its breaker, its LoRA adapter) takes it, as in
        # the proxy's attempts; the list goes on from there for the gateway's retries.
        for i, candidate in enumerate(ranked):
            replica = decision.replica_of(candidate)
            if replica is None:
                continue
            if features.adapter is not None and not await router.lora.ensure(
                replica, features.adapter, self.lora.session
            ):
                continue
            claim = Claim.take(replica, features.prompt_tokens)
            if claim is None:
                continue
            decision.sent(replica)
            tries = [address(c.replica.url) for c in ranked[i:]]
            endpoints = list(dict.fromkeys(tries))[: self.fallbacks]
            return Pick(
                endpoints,
                {"x-request-id": req.record.engine_request_id},
                _removed(req.headers, pool.passthrough_headers),
                self.observe,
                req,
                ticket,
                claim,
                decision,
            )
        raise self._no_replica(f"no replica of pool `{pool.name}` accepted the request")

    def _any(self, headers: Mapping[str, str], subset: Sequence[str] | None) -> Pick | Refusal:
        """A request that is not an inference one (a GET, an unknown path): any ready replica of
        any pool, in turn, as the reference EPP sends a bodiless request to a random endpoint."""
        ready = [address(r.url) for pool in self.pools.values() for r in pool.serving("decode")]
        if subset is not None:
            allowed = set(subset)
            ready = [e for e in ready if e in allowed]
        if not ready:
            return Refusal.of(self._no_replica("no healthy replica"))
        start = next(self._turn) % len(ready)
        endpoints = (ready[start:] + ready[:start])[: self.fallbacks]
        return Pick(endpoints, {}, _removed(headers, frozenset()), self.observe)

    def _no_replica(self, message: str) -> GatewayError:
        retry_after = {"Retry-After": str(max(1, round(self.retry_after_s)))}
        return GatewayError(503, message, "service_unavailable", "no_healthy_replica", headers=retry_after)


def _removed(headers: Mapping[str, str], allowed: frozenset[str]) -> list[str]:
    """Client headers engines would act on (gateway/path/sanitize.py), and the Inference Extension's
    routing hints, which are the EPP's to read: removed before Envoy forwards the request."""
    return [
        name
        for name in headers
        if not name.startswith(":")
        and name not in allowed
        and (name in CONTROL_HEADERS or name.startswith(CONTROL_HEADER_PREFIXES) or name in ROUTING_HINTS)
    ]


def _candidate(decision: Decision, replica: Replica) -> Candidate | None:
    return next((c for c in decision.ranked if c.replica.name == replica.name), None)


def refusal(status: int, message: str, code: str) -> Refusal:
    """A refusal the server makes itself (a body too large, a malformed stream)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return Refusal(status, error_body(message, kind, code))
