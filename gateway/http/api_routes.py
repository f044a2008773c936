"""The non-inference endpoints of the OpenAI surface: the model list and the tokenizer.

`GET /v1/models` and `GET /v1/models/{id}` answer from the gateway's own catalog (vLLM does not serve
the second). `POST /tokenize` and `POST /detokenize` are routed by `model` (optional when the gateway
serves one model, as in vLLM) to a replica of its pool (gateway/path/tokenize.py); each is recorded
for the observers (access log, request metrics) as an inference request is.
"""

from __future__ import annotations

import asyncio
import time

from gateway.config import ServerConfig
from gateway.errors import GatewayError, model_not_found
from gateway.http.auth import Auth
from gateway.http.handling import error_response, new_record
from gateway.http.request_body import read_body
from gateway.http.tenant_caps import TenantCaps
from gateway.path.exchange import Exchange, Reply, Route, json_reply
from gateway.path.request import parse_json_body
from gateway.path.request_record import Observer
from gateway.path.tokenize import Tokenize
from gateway.routing.model_catalog import ModelCatalog


class ApiRoutes:
    def __init__(
        self,
        server: ServerConfig,
        auth: Auth,
        caps: TenantCaps,
        catalog: ModelCatalog,
        tokenize: Tokenize,
        observe: Observer,
    ) -> None:
        self.server = server
        self.auth = auth
        self.caps = caps  # /tokenize's bodies count against the key's cap as inference bodies do
        self.catalog = catalog
        self.tokenize = tokenize
        self.observe = observe

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/models", self.models),
            # Model ids may hold slashes (meta-llama/Llama-3.1-8B-Instruct), as the SDK sends them.
            Route("GET", "/v1/models/", self.model, tail="model"),
            Route("POST", "/tokenize", self.tokenizer),
            Route("POST", "/detokenize", self.tokenizer),
        ]

    async def models(self, request: Exchange) -> Reply:
        self.auth.client(request)
        return json_reply({"object": "list", "data": self.catalog.cards()})

    async def model(self, request: Exchange) -> Reply:
        self.auth.client(request)
        name = request.params["model"]
        card = self.catalog.card(name)
        if card is None:
            raise model_not_found(name)
        return json_reply(card)

    async def tokenizer(self, request: Exchange) -> Reply:
        rec = new_record(request, request.path[1:], inference=False)
        try:
            caller = self.auth.client(request)
            rec.tenant = caller.tenant
            server = self.server
            with self.caps.hold(caller.holder):
                raw = await read_body(request, server)
                body = parse_json_body(raw, server.max_json_depth)
                reply = await self.tokenize.handle(request.path, request.headers, raw, body, rec)
            rec.status = reply.status
            return reply
        except GatewayError as exc:
            return error_response(exc, rec)
        except asyncio.CancelledError:
            rec.client_disconnected = True
            rec.status = 499
            raise
        finally:
            rec.ended = time.perf_counter()
            self.observe(rec)
