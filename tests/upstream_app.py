"""A small OpenAI-compatible upstream for gateway tests, served on a real loopback socket.

It records what arrives (path, headers, parsed body) and behaves as the request's
`x-test-mode` header asks: `status:503`, `stall:SECONDS` (before headers), `midstream:N`
(N SSE chunks, then the connection is cut), `hang-stream` (one chunk, then waits until the
client leaves), `linger:SECONDS` (the whole stream through `data: [DONE]`, then SECONDS before
it ends), `sglang-error` (SGLang's flat error form with 400), `fastapi-422` (FastAPI's
validation error list), `text-error` (a proxy's plain-text 502), `stream-error` (two chunks, then
an error event as vLLM streams one, then `[DONE]`), `echo-model` (the content names the model, also
as JSON text, and a stream is written in 7-byte pieces), default: answer normally.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict


@dataclass
class Seen:
    path: str
    headers: CIMultiDict[str]  # case-insensitive, as HTTP headers are
    body: dict[str, Any]
    raw: bytes


@dataclass
class UpstreamState:
    name: str
    seen: list[Seen] = field(default_factory=list)
    disconnects: list[float] = field(default_factory=list)  # monotonic times a client went away
    healthy: bool = True
    force_status: int | None = None  # answer every request with this error status
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


def _echo(body: dict[str, Any]) -> str:
    model = body.get("model")
    return f'model {model} says {{"model":"{model}"}}'


def _completion(state: UpstreamState, body: dict[str, Any], path: str, echo: bool = False) -> dict[str, Any]:
    text = _echo(body) if echo else f"hello from {state.name}"
    if path.endswith("chat/completions"):
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "stop"}
        obj = "text_completion"
    return {
        "id": "cmpl-test",
        "object": obj,
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def _chunk(body: dict[str, Any], path: str, i: int, echo: bool = False) -> bytes:
    text = _echo(body) if echo else f"tok{i} "
    if path.endswith("chat/completions"):
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": None}
        obj = "text_completion"
    doc = {"id": "cmpl-test", "object": obj, "created": 0, "model": body.get("model"), "choices": [choice]}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def build_upstream(state: UpstreamState, chunks: int = 5) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        state.seen.append(Seen(request.path, request.headers.copy(), body, raw))
        mode = request.headers.get("x-test-mode", "")
        if state.force_status is not None:
            mode = f"status:{state.force_status}"
        kind, _, arg = mode.partition(":")
        rid = {"x-request-id": request.headers.get("x-request-id", "")}
        if kind == "status":
            status = int(arg)
            err = {
                "error": {
                    "message": f"{state.name} says {status}",
                    "type": "server_error",
                    "param": None,
                    "code": status,
                }
            }
            return web.json_response(err, status=status, headers=rid)
        if kind == "sglang-error":
            flat = {
                "object": "error",
                "message": "bad sampling params",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
            return web.json_response(flat, status=400)
        if kind == "fastapi-422":
            detail = [{"type": "missing", "loc": ["body", "messages"], "msg": "Field required", "input": {}}]
            return web.json_response({"detail": detail}, status=422)
        if kind == "text-error":
            return web.Response(status=502, text="upstream connect error or disconnect/reset before headers")
        if kind == "stall":
            await asyncio.sleep(float(arg))
        echo = kind == "echo-model"
        if not body.get("stream"):
            return web.json_response(_completion(state, body, request.path, echo), headers=rid)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **rid})
        await resp.prepare(request)
        try:
            if kind == "midstream":
                for i in range(int(arg)):
                    await resp.write(_chunk(body, request.path, i))
                assert request.transport is not None
                request.transport.abort()  # cut the connection: no [DONE], no final chunk
                return resp
            if kind == "hang-stream":
                await resp.write(_chunk(body, request.path, 0))
                await asyncio.Event().wait()
            if kind == "stream-error":
                for i in range(2):
                    await resp.write(_chunk(body, request.path, i))
                err = {
                    "message": "engine overloaded",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
                await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            piece = 7 if echo else None  # small writes: SSE events cut anywhere on the wire
            for i in range(chunks):
                data = _chunk(body, request.path, i, echo)
                for start in range(0, len(data), piece or len(data)):
                    await resp.write(data[start : start + (piece or len(data))])
            await resp.write(b"data: [DONE]\n\n")
            if kind == "linger":
                await asyncio.sleep(float(arg))
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            state.disconnects.append(time.monotonic())
            state.disconnected.set()
            raise
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if state.healthy else 503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", completions)
    app.router.add_get("/health", health)
    return app


class Upstream:
    """A running upstream on 127.0.0.1 with an ephemeral port."""

    def __init__(self, name: str, chunks: int = 5) -> None:
        self.state = UpstreamState(name)
        self._app = build_upstream(self.state, chunks)
        self._runner = web.AppRunner(self._app, handler_cancellation=True, access_log=None)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Upstream:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()
