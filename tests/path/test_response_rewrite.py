"""What the gateway changes in answers it relays: the model's name, and engine errors' shape.

The test upstream (a real server on loopback) echoes the engine-side model name inside the content,
also as JSON text, and writes its stream in 7-byte pieces, so events reach the gateway cut anywhere.
"""

from __future__ import annotations

import httpx
import openai
import orjson

from tests.conftest import gateway_settings

INTERNAL = "llama-3.1-8b-fp8"


def _settings(url: str):  # type: ignore[no-untyped-def]
    return gateway_settings(
        [url],
        pool={"model": "m", "served_model": INTERNAL},
        routes=[{"model": "llama", "rules": [{"pools": [{"name": "p"}]}]}],
    )


async def test_canary_name_never_leaks_and_content_is_untouched(upstreams, gateway) -> None:  # type: ignore[no-untyped-def]
    (up,) = await upstreams(1)
    gw = await gateway(_settings(up.url))
    echoed = f'model {INTERNAL} says {{"model":"{INTERNAL}"}}'
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"x-test-mode": "echo-model"},
    ) as client:
        chat = await client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "x"}]
        )
        assert chat.model == "llama" and chat.choices[0].message.content == echoed
        stream = await client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "x"}], stream=True
        )
        chunks = [c async for c in stream]
        assert {c.model for c in chunks} == {"llama"}
        assert [c.choices[0].delta.content for c in chunks] == [echoed] * 5
        text = await client.completions.create(model="m", prompt="x", stream=True)
        assert {c.model async for c in text} == {"m"}
    assert up.state.seen[0].body["model"] == INTERNAL  # the engine got its own name


async def test_engine_error_shapes_through_the_gateway(upstreams, gateway) -> None:  # type: ignore[no-untyped-def]
    (up,) = await upstreams(1)
    gw = await gateway(_settings(up.url))
    body = {"model": "llama", "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=body, headers={"x-test-mode": "fastapi-422"})
        assert r.status_code == 422
        assert r.json()["error"] == {
            "message": "messages: Field required",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "validation_error",
        }
        r = await c.post("/v1/chat/completions", json=body, headers={"x-test-mode": "text-error"})
        assert r.status_code == 502
        assert r.json()["error"]["message"] == "upstream connect error or disconnect/reset before headers"
        # An error event in the middle of a stream, as vLLM sends one.
        r = await c.post(
            "/v1/chat/completions", json={**body, "stream": True}, headers={"x-test-mode": "stream-error"}
        )
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert [orjson.loads(e)["model"] for e in events[:2]] == ["llama", "llama"]
        assert orjson.loads(events[2]) == {
            "error": {
                "message": "engine overloaded",
                "type": "upstream_error",
                "param": None,
                "code": "service_unavailable",
            }
        }
        assert events[3] == "[DONE]"
