"""The non-inference endpoints of the OpenAI surface: the model list and the tokenizer.

`GET /v1/models` and `GET /v1/models/{id}` answer from the gateway's own catalog (vLLM does not serve
the second). `POST /tokenize` and `POST /detokenize` are routed by `model` (optional when the gateway
serves one model, as in vLLM) to a replica of its pool (gateway/path/tokenize.py).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.config import ServerConfig
from gateway.errors import model_not_found
from gateway.http.auth import Auth
from gateway.http.request_body import read_body
from gateway.path.request import parse_json_body
from gateway.path.tokenize import Tokenize
from gateway.routing.model_catalog import ModelCatalog


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class ApiRoutes:
    def __init__(self, server: ServerConfig, auth: Auth, catalog: ModelCatalog, tokenize: Tokenize) -> None:
        self.server = server
        self.auth = auth
        self.catalog = catalog
        self.tokenize = tokenize

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            # Model ids may hold slashes (meta-llama/Llama-3.1-8B-Instruct), as the SDK sends them.
            web.get("/v1/models/{model:.+}", self.model),
            web.post("/tokenize", self.tokenizer),
            web.post("/detokenize", self.tokenizer),
        ]

    async def models(self, request: web.Request) -> web.Response:
        self.auth.client(request)
        return _json({"object": "list", "data": self.catalog.cards()})

    async def model(self, request: web.Request) -> web.Response:
        self.auth.client(request)
        name = request.match_info["model"]
        card = self.catalog.card(name)
        if card is None:
            raise model_not_found(name)
        return _json(card)

    async def tokenizer(self, request: web.Request) -> web.Response:
        self.auth.client(request)
        server = self.server
        raw = await read_body(request, server.max_body_bytes, server.body_timeout_s)
        body = parse_json_body(raw, server.max_json_depth)
        return await self.tokenize.handle(request.path, request.headers, raw, body)
