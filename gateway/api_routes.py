"""The non-inference endpoints of the OpenAI surface: the model list and the tokenizer.

`GET /v1/models` and `GET /v1/models/{id}` answer from the gateway's own catalog (vLLM does not serve
the second). `POST /tokenize` and `POST /detokenize` are routed by `model` (optional when the gateway
serves one model, as in vLLM) to a replica of its pool, the least busy first, and answered by it: they
are cheap, so they skip the scheduler, take no lease and teach the prefix index nothing. A replica that
cannot be reached is passed over for the next.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.errors import GatewayError, normalize_error_body
from gateway.logs import clip
from gateway.request_body import parse_json_body, read_body
from gateway.upstream import UpstreamError

if TYPE_CHECKING:
    from gateway.model_catalog import Target
    from gateway.replica import Replica
    from gateway.runtime import Runtime

log = logging.getLogger(__name__)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class ApiRoutes:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            # Model ids may hold slashes (meta-llama/Llama-3.1-8B-Instruct), as the SDK sends them.
            web.get("/v1/models/{model:.+}", self.model),
            web.post("/tokenize", self.tokenizer),
            web.post("/detokenize", self.tokenizer),
        ]

    async def models(self, request: web.Request) -> web.Response:
        self.rt.auth.client(request)
        return _json({"object": "list", "data": self.rt.models.cards()})

    async def model(self, request: web.Request) -> web.Response:
        self.rt.auth.client(request)
        name = request.match_info["model"]
        card = self.rt.models.card(name)
        if card is None:
            raise GatewayError(
                404,
                f"the model `{clip(name)}` does not exist",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return _json(card)

    async def tokenizer(self, request: web.Request) -> web.Response:
        self.rt.auth.client(request)
        server = self.rt.settings.server
        raw = await read_body(request, server.max_body_bytes, server.body_timeout_s)
        body = parse_json_body(raw, server.max_json_depth)
        target = self.rt.models.resolve(self._model(body), None, request.headers, body)
        if body.get("model") != target.upstream:
            body["model"] = target.upstream
            raw = orjson.dumps(body)
        replicas = self._replicas(target)
        if not replicas:
            raise GatewayError(
                503,
                f"no healthy replica in pool `{target.pool.name}`",
                "service_unavailable",
                "no_healthy_replica",
                headers={"Retry-After": str(self.rt.settings.scheduler.retry_after_s)},
            )
        headers = {"Content-Type": "application/json", "X-Request-Id": os.urandom(16).hex()}
        failure = "no replica answered"
        for replica in replicas[: self.rt.settings.retry.max_attempts]:
            try:
                resp = await self.rt.upstream.open("POST", replica.url + request.path, raw, headers)
                try:
                    answer = await self.rt.upstream.read(resp)
                except BaseException:
                    resp.close()  # the body was not read to its end: the connection is not reusable
                    raise
                resp.release()
            except UpstreamError as exc:
                log.warning("%s on replica %s failed: %s", request.path, replica.name, exc)
                failure = str(exc)
                continue
            if resp.status >= 400:
                answer = normalize_error_body(answer, resp.status)
            out = web.Response(status=resp.status, body=answer, content_type="application/json")
            out.headers["x-kvgate-replica"] = replica.name
            return out
        raise GatewayError(502, failure, "upstream_error", "upstream_unreachable")

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None or model == "":
            names = {p.model for p in self.rt.pools.values()}
            if len(names) == 1 and not self.rt.router.routes:
                return next(iter(names))  # one model served: vLLM's `model` is optional here
            raise GatewayError(
                400, "you must provide a model parameter", "invalid_request_error", "missing_model", "model"
            )
        if not isinstance(model, str):
            raise GatewayError(
                400, "`model` must be a string", "invalid_request_error", "invalid_model", "model"
            )
        return model

    def _replicas(self, target: Target) -> list[Replica]:
        pool = target.pool
        replicas = pool.serving("decode")
        if target.adapter is not None:
            replicas = [r for r in replicas if pool.lora.has(r.name, target.adapter)]
        return sorted(replicas, key=lambda r: r.inflight_requests + r.remote_inflight_requests)
