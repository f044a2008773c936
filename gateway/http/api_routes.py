"""The non-inference endpoints of the OpenAI surface: the model list and the tokenizer.

`GET /v1/models` and `GET /v1/models/{id}` answer from the gateway's own catalog (vLLM does not serve
the second). `POST /tokenize` and `POST /detokenize` are routed by `model` (optional when the gateway
serves one model, as in vLLM) to a replica of its pool (gateway/path/tokenize.py).
"""

from __future__ import annotations

from gateway.config import ServerConfig
from gateway.errors import model_not_found
from gateway.http.auth import Auth
from gateway.http.request_body import read_body
from gateway.path.exchange import Exchange, Reply, Route, json_reply
from gateway.path.request import parse_json_body
from gateway.path.tokenize import Tokenize
from gateway.routing.model_catalog import ModelCatalog


class ApiRoutes:
    def __init__(self, server: ServerConfig, auth: Auth, catalog: ModelCatalog, tokenize: Tokenize) -> None:
        self.server = server
        self.auth = auth
        self.catalog = catalog
        self.tokenize = tokenize

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
        self.auth.client(request)
        server = self.server
        raw = await read_body(request, server.max_body_bytes, server.body_timeout_s)
        body = parse_json_body(raw, server.max_json_depth)
        return await self.tokenize.handle(request.path, request.headers, raw, body)
