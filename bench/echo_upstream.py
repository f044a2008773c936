"""A minimal OpenAI-shaped upstream for measuring the gateway's own overhead.

It answers instantly (a tiny JSON completion, or a short SSE stream), so any latency the
overhead benchmark sees on top of it is the gateway's (or the client's). Run:
`python -m bench.echo_upstream --port P [--enable-request-id-headers]`; with the flag, as vLLM
with it, every answer carries the request's X-Request-Id, which is what lets the gateway keep
connections to it.
"""

from __future__ import annotations

import argparse

from aiohttp import web

COMPLETION = (
    b'{"id":"cmpl-echo","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
CHUNK = (
    b'data: {"id":"cmpl-echo","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b'"stream":true' not in body.replace(b" ", b""):
        return web.Response(body=COMPLETION, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(4):
        await resp.write(CHUNK)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", "")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--enable-request-id-headers", action="store_true")
    args = parser.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)  # large prompts too (bench.loop_block)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    if args.enable_request_id_headers:
        app.on_response_prepare.append(echo_request_id)
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop() if uvloop else None,
    )


if __name__ == "__main__":
    main()
