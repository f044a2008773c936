"""The preparation step: from a client's bytes to the request object that admission and dispatch read.

In order: parse the body; resolve the model to a pool, maybe one of its LoRA adapters (the model
catalog: rollout routes, pools' models, adapters, by the endpoint's task); remove what clients may
not send engines and name the engines' own model (and how the answer names the client's);
canonicalize and measure the prompt (tokens, prefix block hashes); set its priority class; apply
the prompt limit (400, or the window that drops the oldest turns); set the engine's `priority`
field; in precise prefix mode, have an engine tokenize the prompt. Every change to the body goes
through the request object, which knows whether the client's bytes can be sent as they are.

A large body (`server.offload_body_bytes`) is parsed, canonicalized, hashed and counted in a
worker thread: on the event loop a 7.5 MB prompt took 0.6 s, during which no other request moved.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

import orjson

from gateway.admission.classes import PriorityClasses
from gateway.config import ServerConfig
from gateway.errors import GatewayError, client_error
from gateway.logs import clip
from gateway.path.model_names import Renames
from gateway.path.request import InferenceRequest, parse_json_body
from gateway.path.request_record import RequestRecord
from gateway.path.sanitize import new_request_id
from gateway.path.trace import Tracer
from gateway.path.upstream import Upstream, UpstreamError
from gateway.path.work_bounds import sequences
from gateway.prompt.canonicalize import canonicalize
from gateway.prompt.prefix_hash import PrefixHasher
from gateway.routing.model_catalog import ModelCatalog, Target

log = logging.getLogger(__name__)

_JSON = {"Content-Type": "application/json"}


class Preparation:
    def __init__(
        self,
        server: ServerConfig,
        catalog: ModelCatalog,
        classes: PriorityClasses,
        upstream: Upstream,
        workers: Executor,
        tracer: Tracer,
    ) -> None:
        self.server = server
        self.catalog = catalog
        self.renames = Renames()
        self.classes = classes
        self.upstream = upstream
        self.workers = workers  # one thread: the loop competes with at most one other GIL holder
        self.tracer = tracer

    async def prepare(
        self, path: str, headers: Mapping[str, str], raw: bytes, tenant: str | None, rec: RequestRecord
    ) -> InferenceRequest:
        server = self.server
        offload = len(raw) > server.offload_body_bytes
        if offload:
            body = await asyncio.get_running_loop().run_in_executor(
                self.workers, parse_json_body, raw, server.max_json_depth
            )
        else:
            body = parse_json_body(raw, server.max_json_depth)
        target = self._resolve(body, headers, rec)
        answers = sequences(body, rec.endpoint, server)  # before the prompt is measured: 400s are cheap
        router = target.router
        req = InferenceRequest(path, headers, raw, body, tenant, rec, router)
        req.rename = self.renames.get(target.engine_names, body["model"])
        self._engine_fields(req, target.upstream)
        if offload:
            # The worker reads the pool's caches through a detached hasher; what it learned joins
            # them back here, on the loop.
            hasher = router.detached()
            call = contextvars.copy_context().run
            measure = functools.partial(call, self._measure, req, hasher)
            await asyncio.get_running_loop().run_in_executor(self.workers, measure)
            router.absorb(hasher, req.features)
        else:
            self._measure(req)
        req.features.sequences = answers
        classify(req, self.classes)
        fit_prompt(req, self.classes)
        forward_priority(req, self.classes)
        if router.engine_tokens is not None:
            with self.tracer.span("tokenize"):
                await self._engine_tokens(req)
        features = req.features
        rec.stream = features.stream
        rec.prompt_tokens = features.prompt_tokens
        rec.prompt_chars = len(features.text)
        rec.priority_class = features.priority_class
        return req

    def _resolve(self, body: dict[str, Any], headers: Mapping[str, str], rec: RequestRecord) -> Target:
        """Where the request's model is served (rollout rules apply), for its endpoint."""
        model = body.get("model")
        if model is None or model == "":
            raise client_error("you must provide a model parameter", "missing_model", "model")
        if not isinstance(model, str):
            raise client_error("`model` must be a string", "invalid_model", "model")
        rec.model = clip(model)
        target = self.catalog.resolve(model, rec.endpoint, headers, body)
        rec.pool = target.router.name
        return target

    @staticmethod
    def _engine_fields(req: InferenceRequest, upstream: str) -> None:
        """Remove what the client may not send the pool's engines; name the engines' `upstream` model."""
        removed = req.strip(req.router.pool.passthrough_fields)
        if removed:
            log.debug("request %s: client fields not for engines removed: %s", req.record.request_id, removed)
        if req.body.get("model") != upstream:
            req.set("model", upstream)

    def _measure(self, req: InferenceRequest, hasher: PrefixHasher | None = None) -> None:
        """Canonicalize (when the pool does) and measure the prompt. With a detached `hasher` it
        runs off the event loop and touches none of the pool's state."""
        router = req.router
        canon = router.pool.cfg.canonicalize
        if canon.enabled and not req.headers.get(canon.opt_out_header):
            with self.tracer.span("canonicalize"):
                result = canonicalize(req.body, canon, req.endpoint)
            if result.body is not req.body:
                req.replace(result.body)
                log.debug("request %s canonicalized: %s", req.record.request_id, "; ".join(result.notes))
        rec = req.record
        req.features = router.features(req.body, req.endpoint, rec.engine_request_id, req.headers, hasher)
        req.features.tenant = req.tenant

    async def _engine_tokens(self, req: InferenceRequest) -> None:
        """Precise prefix mode: the engine's own token ids of the prompt, from one of the pool's engines."""
        precise = req.router.engine_tokens
        assert precise is not None
        request = precise.tokenize_request(req.body, req.endpoint)
        replicas = req.router.pool.serving("decode")
        ids = None
        if request is not None and replicas:
            replica = precise.next_replica(replicas)
            try:
                resp = await self.upstream.open(
                    "POST",
                    replica.url + "/tokenize",
                    orjson.dumps(request),
                    {**_JSON, "X-Request-Id": new_request_id()},  # what proves the answer is its own
                )
                try:
                    raw = await self.upstream.read_content(resp)
                finally:
                    resp.release()
            except UpstreamError as exc:
                precise.failed(replica, str(exc))
            else:
                ids = precise.token_ids(replica, resp.status, raw)
        precise.annotate(req.features, ids)


def classify(req: InferenceRequest, classes: PriorityClasses) -> None:
    """The request's class: header `x-priority`, else a class name in body `priority` (removed:
    engines expect an integer there), else the default; lowered to the tenant's highest."""
    name = req.headers.get("x-priority")
    body_priority = req.body.get("priority")
    if isinstance(body_priority, str) and body_priority in classes.levels:
        req.drop("priority")
        name = name or body_priority
    req.features.priority_class, req.features.priority = classes.classify(name, req.tenant)


def fit_prompt(req: InferenceRequest, classes: PriorityClasses) -> None:
    """Apply the prompt size limit: the window policy drops the oldest turns (and the prompt is
    measured again); otherwise, or when it cannot fit, 400."""
    features = req.features
    limit, overflow = classes.prompt_limit(req.tenant)
    if limit is None or features.prompt_tokens <= limit:
        return
    if overflow == "window" and req.trim(limit):
        classes.prompts_trimmed += 1
        rec = req.record
        trimmed = req.router.features(req.body, req.endpoint, rec.engine_request_id, req.headers)
        trimmed.tenant = features.tenant
        trimmed.priority_class = features.priority_class
        trimmed.priority = features.priority
        trimmed.sequences = features.sequences
        req.features = trimmed
        return
    raise classes.prompt_too_large(features.priority_class, features.prompt_tokens, limit)


def forward_priority(req: InferenceRequest, classes: PriorityClasses) -> None:
    """Set body `priority` in the engine's own direction when the pool's engines schedule by
    priority and the client did not choose an engine priority; drop a client's integer when they
    do not.

    A client's own integer is the engine's priority, so a tenant with `max_priority` may not use it
    to outrank its cap: it is lowered to the engine value of that class (and must be an integer:
    engines would coerce a string or float)."""
    pool = req.router.pool
    given = req.body.get("priority")
    adapter = pool.priority_adapter()
    if given is None:
        if adapter is not None:
            req.set("priority", adapter.engine_priority(req.features.priority))
        return
    if adapter is None and isinstance(given, int) and not isinstance(given, bool):
        # Engines that do not schedule by priority refuse a nonzero one (vLLM: "Got priority N but
        # Priority scheduling is not enabled."); the gateway's own scheduling still orders it.
        req.drop("priority")
        return
    ceiling = classes.ceiling(req.tenant)
    if ceiling is None:
        return
    if isinstance(given, bool) or not isinstance(given, int):
        raise GatewayError(
            400,
            "`priority` must be an integer (the engine's priority) or a priority class name",
            "invalid_request_error",
            "invalid_priority",
            "priority",
        )
    direction = pool.direction_adapter()
    if direction is None:  # no engine known to read it: nothing to check it against
        req.drop("priority")
        return
    allowed = direction.cap_priority(given, ceiling)
    if allowed != given:
        req.set("priority", allowed)
        classes.priority_lowered += 1
