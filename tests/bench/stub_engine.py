"""A tiny OpenAI-compatible streaming engine for benchmark tests, on real loopback sockets.

It streams `max_tokens` chunks with a fixed first-token delay and gap, reports usage with
cached tokens from a per-replica prefix cache (chained hashes of 16-token blocks of the shared
tokenizer), and obeys test headers: `x-stub-status` (answer that status with an OpenAI error,
with `x-stub-retry-after` as its Retry-After), `x-stub-ttft-ms`, `x-stub-itl-ms`. Run as
`python -m tests.bench.stub_engine --model M --port P --replicas N` (the simulator's command line;
other flags are accepted and ignored) to stand in for a fleet in scenario tests.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway.prompt.tokens import get_tokenizer

BLOCK = 16


@dataclass
class StubState:
    model: str
    ttft_ms: float = 5.0
    itl_ms: float = 2.0
    cache: set[bytes] = field(default_factory=set)
    requests: list[dict[str, Any]] = field(default_factory=list)
    token_times: list[list[float]] = field(default_factory=list)  # per request: perf_counter per token


def _cached_tokens(state: StubState, tokens: list[int]) -> int:
    parent = b""
    cached = 0
    hit = True
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.blake2b(parent + orjson.dumps(tokens[i * BLOCK : (i + 1) * BLOCK])).digest()
        if hit and parent in state.cache:
            cached += BLOCK
        else:
            hit = False
            state.cache.add(parent)
    return cached


def _chunk(chat: bool, model: str, content: str | None, usage: dict[str, Any] | None = None) -> bytes:
    if content is None:
        choices: list[dict[str, Any]] = []
    elif chat:
        choices = [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    else:
        choices = [{"index": 0, "text": content, "finish_reason": None}]
    doc: dict[str, Any] = {"id": "stub", "object": "chunk", "model": model, "choices": choices}
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def build_app(state: StubState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.requests.append({"headers": dict(request.headers), "body": body})
        status = int(request.headers.get("x-stub-status", "200"))
        if status != 200:
            error = {"message": f"stub says {status}", "type": "server_error", "param": None, "code": status}
            retry_after = request.headers.get("x-stub-retry-after")
            headers = {"Retry-After": retry_after} if retry_after else None
            return web.json_response({"error": error}, status=status, headers=headers)
        chat = request.path.endswith("chat/completions")
        text = "".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        tokens = get_tokenizer().encode(text)
        cached = _cached_tokens(state, tokens)
        ttft = float(request.headers.get("x-stub-ttft-ms", state.ttft_ms)) / 1000.0
        itl = float(request.headers.get("x-stub-itl-ms", state.itl_ms)) / 1000.0
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(ttft)
        n = int(body.get("max_tokens") or 16)
        sent_at: list[float] = []
        state.token_times.append(sent_at)
        for i in range(n):
            if i:
                await asyncio.sleep(itl)
            sent_at.append(time.perf_counter())
            await resp.write(_chunk(chat, state.model, " tok"))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": len(tokens),
                "completion_tokens": n,
                "total_tokens": len(tokens) + n,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            await resp.write(_chunk(chat, state.model, None, usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


async def start(state: StubState, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def _serve(args: argparse.Namespace) -> None:
    get_tokenizer()  # load before serving, so the first request's TTFT does not include it
    for i in range(args.replicas):
        await start(StubState(args.model, args.ttft_ms, args.itl_ms), args.port + i)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--ttft-ms", type=float, default=5.0)
    p.add_argument("--itl-ms", type=float, default=2.0)
    args, _ = p.parse_known_args()
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
