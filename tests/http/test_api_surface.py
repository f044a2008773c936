"""The OpenAI surface through the gateway, driven by the openai SDK against simulator processes.

One generative simulator (served names `internal-fp8` and `m`, adapter `sql`) behind pool `gen`, one
embedding simulator (`emb`) behind pool `embed`, and routes `llama` (pool gen), `assistant` (pool gen,
adapter sql) and `raw` (pool gen, responses keep the engine's name).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.config import BreakerConfig, ScrapeConfig, Settings, load_config
from gateway.fleet.pool import Pool
from gateway.routing.pool_router import PoolRouter
from tests.conftest import gateway_settings, wait_until
from tests.simfleet import sim_process


@pytest.fixture(scope="module")
def gen_sim() -> Iterator[str]:
    args = (
        "--served-model-name",
        "internal-fp8",
        "m",
        "--enable-lora",
        "--lora-modules",
        "sql=/adapters/sql",
    )
    with sim_process(*args, "--max-model-len", "4096") as url:
        yield url


@pytest.fixture(scope="module")
def embed_sim() -> Iterator[str]:
    with sim_process("--runner", "pooling", "--served-model-name", "emb") as url:
        yield url


def settings(gen: str, emb: str) -> Settings:
    base = gateway_settings([gen]).model_dump(exclude_unset=True)
    base["pools"] = [
        {
            "name": "gen",
            "model": "m",
            "served_model": "internal-fp8",
            "endpoints": [{"url": gen, "name": "g0"}],
            "lora": {"adapters": [{"name": "sql"}], "discover": True, "discover_interval_s": 0.2},
        },
        {"name": "embed", "model": "emb", "tasks": ["embed"], "endpoints": [{"url": emb, "name": "e0"}]},
    ]
    base["routes"] = [
        {"model": "llama", "rules": [{"pools": [{"name": "gen"}]}]},
        {"model": "assistant", "rules": [{"pools": [{"name": "gen", "adapter": "sql"}]}]},
        {"model": "raw", "rules": [{"pools": [{"name": "gen"}]}], "rewrite_model": False},
    ]
    return load_config(None, base)


@pytest.fixture
async def client(gen_sim, embed_sim, gateway):  # type: ignore[no-untyped-def]
    gw = await gateway(settings(gen_sim, embed_sim))
    lora = gw.runtime.routers["gen"].lora
    await wait_until(lambda: lora.max_model_len is not None, what="the engine's /v1/models to be read")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as c:
        c.gateway_url = gw.url  # type: ignore[attr-defined]
        yield c


CHAT = [{"role": "user", "content": "hello there"}]


async def test_models_list_and_retrieve(client: openai.AsyncOpenAI) -> None:
    cards = {m.id: m.model_dump() for m in (await client.models.list()).data}
    assert list(cards) == ["llama", "assistant", "raw", "m", "emb", "sql"]
    assert cards["assistant"]["parent"] == "m" and cards["sql"]["parent"] == "m"
    assert cards["m"]["parent"] is None and cards["m"]["owned_by"] == "kvgate"
    # Learned from the engine's /v1/models: its context length (the internal name never shows).
    assert cards["m"]["max_model_len"] == 4096 and cards["llama"]["max_model_len"] == 4096
    assert "internal-fp8" not in str(cards)
    one = await client.models.retrieve("sql")
    assert one.id == "sql" and one.model_dump()["parent"] == "m"
    with pytest.raises(openai.NotFoundError) as exc:
        await client.models.retrieve("org/nope")
    assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_context_length_listed_without_lora_discovery(client: openai.AsyncOpenAI) -> None:
    """Pool `embed` does not discover adapters; its engines' context length is read all the same."""

    async def listed() -> object:
        cards = {m.id: m.model_dump() for m in (await client.models.list()).data}
        return cards["emb"]["max_model_len"]

    assert await wait_until(listed, 15, "emb's max_model_len in /v1/models") == 131072


async def test_an_over_long_prompt_is_context_length_exceeded(client: openai.AsyncOpenAI) -> None:
    """vLLM's current text for it ("... the model's context length is only 4096 tokens ...") gets
    OpenAI's code, streamed or not."""
    long = [{"role": "user", "content": "word " * 5000}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="llama", messages=long, max_tokens=8, stream=stream)
        err = exc.value.body
        assert err["code"] == "context_length_exceeded" and err["param"] == "input_tokens"  # type: ignore[index]
        assert "context length is only 4096 tokens" in err["message"]  # type: ignore[index]


# LiteLLM's view of an over-long prompt, asked of the gateway as an OpenAI-compatible provider: the
# class of the exception it raises, and its message. In a process of its own: LiteLLM reads .env files
# and patches logging when imported. Its cost map is the bundled one (no download).
LITELLM_CALL = """
import sys, litellm
litellm.suppress_debug_info = True
try:
    litellm.completion(model="openai/llama", api_base=sys.argv[1], api_key="unused", max_tokens=8,
                       messages=[{"role": "user", "content": "word " * 5000}], num_retries=0)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


async def test_litellm_sees_an_over_long_prompt_as_a_context_window_error(
    client: openai.AsyncOpenAI,
) -> None:
    """LiteLLM decides by the message's text; vLLM 0.26's wording is not among those it knows, so
    without OpenAI's sentence after it LiteLLM raised a plain BadRequestError (no fallback to a
    longer-context model)."""
    if importlib.util.find_spec("litellm") is None:
        pytest.skip("litellm is not installed (pip install litellm): its mapping of the error is unchecked")
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", LITELLM_CALL, client.gateway_url + "/v1"],  # type: ignore[attr-defined]
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("ContextWindowExceededError "), done.stdout + done.stderr[-2000:]
    assert "context length is only 4096 tokens" in done.stdout  # vLLM's own text still there


async def test_generation_names_the_model_the_client_asked_for(client: openai.AsyncOpenAI) -> None:
    for model in ("m", "llama", "assistant", "sql"):
        chat = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=3)
        assert chat.model == model
        stream = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, stream=True)
        assert {c.model async for c in stream} == {model}
    raw = await client.chat.completions.create(model="raw", messages=CHAT, max_tokens=2)
    assert raw.model == "internal-fp8"  # rewrite_model: false
    batch = await client.completions.create(model="llama", prompt=["one two", "three"], max_tokens=2, n=2)
    assert batch.model == "llama" and sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    ids = await client.completions.create(model="m", prompt=[[791, 1176], [791]], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage is not None and ids.usage.prompt_tokens == 3
    resp = await client.responses.create(model="assistant", input="hi", max_output_tokens=3)
    assert resp.model == "assistant" and resp.output_text
    events = await client.responses.create(model="llama", input="hi", max_output_tokens=3, stream=True)
    models = {e.response.model async for e in events if hasattr(e, "response")}
    assert models == {"llama"}


async def test_pooling_endpoints_and_tasks(client: openai.AsyncOpenAI) -> None:
    emb = await client.embeddings.create(model="emb", input=["garden rake", "garden hoe"], dimensions=8)
    assert emb.model == "emb" and [len(d.embedding) for d in emb.data] == [8, 8]
    base = client.gateway_url  # type: ignore[attr-defined]
    pooled = await client.post(f"{base}/pooling", body={"model": "emb", "input": "rake"}, cast_to=object)
    assert pooled["data"][0]["object"] == "pooling"  # type: ignore[index]
    for path in ("/score", "/v1/score"):
        score = await client.post(
            base + path, body={"model": "emb", "text_1": "rake", "text_2": ["rake", "hoe"]}, cast_to=object
        )
        assert [d["index"] for d in score["data"]] == [0, 1]  # type: ignore[index]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = await client.post(
            base + path, body={"model": "emb", "query": "rake", "documents": ["hoe", "rake"]}, cast_to=object
        )
        assert ranked["results"][0]["document"]["text"] == "rake"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        await client.embeddings.create(model="llama", input="x")
    assert exc.value.body["code"] == "unsupported_task" and "generate" in exc.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="emb", messages=CHAT)
    assert exc.value.body["code"] == "unsupported_task"  # type: ignore[index]


async def test_tokenize_and_detokenize_by_model(
    client: openai.AsyncOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.access")
    base = client.gateway_url  # type: ignore[attr-defined]
    tok = await client.post(
        f"{base}/tokenize",
        body={"model": "assistant", "prompt": "hello world"},
        cast_to=object,
        options={"headers": {"x-request-id": "tok-1"}},
    )
    assert tok["count"] == 2 and tok["max_model_len"] == 4096  # type: ignore[index]
    chat = await client.post(f"{base}/tokenize", body={"model": "llama", "messages": CHAT}, cast_to=object)
    assert chat["count"] > tok["count"]  # type: ignore[index]
    text = await client.post(
        f"{base}/detokenize", body={"model": "emb", "tokens": tok["tokens"]}, cast_to=object
    )  # type: ignore[index]
    assert text == {"prompt": "hello world"}
    with pytest.raises(openai.BadRequestError) as exc:  # two models served: which tokenizer?
        await client.post(f"{base}/tokenize", body={"prompt": "x"}, cast_to=object)
    assert exc.value.body["code"] == "missing_model"  # type: ignore[index]
    # Each is in the access log, and counted by endpoint, but not as a routed inference request.
    logged = [r.fields for r in caplog.records if r.name == "kvgate.access"]  # type: ignore[attr-defined]
    assert [(f["endpoint"], f["status"]) for f in logged] == [
        ("tokenize", 200),
        ("tokenize", 200),
        ("detokenize", 200),
        ("tokenize", 400),
    ]
    assert logged[0]["request_id"] == "tok-1" and logged[0]["model"] == "assistant"
    assert (logged[2]["pool"], logged[2]["replica"]) == ("embed", "e0")
    assert logged[3]["error"] == "missing_model" and logged[3]["pool"] is None
    async with httpx.AsyncClient() as h:
        metrics = (await h.get(base + "/metrics")).text
    detokenized = 'endpoint="detokenize",model="emb",pool="embed",replica="e0",status="200"} 1.0'
    assert "kvgate_requests_total{" + detokenized in metrics
    assert re.search(r'kvgate_request_duration_seconds_count\{[^}]*pool="embed"', metrics) is None


async def test_engine_errors_and_unknown_paths_in_one_shape(client: openai.AsyncOpenAI) -> None:
    # vLLM's request-schema error ("Bad Request", int code): the engine's text, OpenAI's fields.
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="llama", messages=CHAT, temperature="hot")  # type: ignore[arg-type]
    body = exc.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "invalid_request_body"  # type: ignore[index]
    assert body["param"] == "temperature" and "1 validation error" in body["message"]  # type: ignore[index]
    # vLLM's serving check ("BadRequestError", int code).
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="m", messages=CHAT, max_tokens=100_000)
    assert exc.value.body["code"] == "bad_request" and "max_tokens=100000" in exc.value.message  # type: ignore[index]
    base = client.gateway_url  # type: ignore[attr-defined]
    async with httpx.AsyncClient() as h:
        for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/nothing"), ("GET", "/v1/models/")):
            r = await h.request(method, base + path)
            assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_batched_and_token_id_prompts_are_counted_whole() -> None:
    cfg = gateway_settings(["http://127.0.0.1:1"]).pools[0]
    pool = PoolRouter(Pool(cfg, BreakerConfig(), ScrapeConfig()))
    one = pool.features({"model": "m", "prompt": "the garden rake"}, "completions", "r", {}).prompt_tokens
    batch = pool.features({"model": "m", "prompt": ["the garden rake"] * 3}, "completions", "r", {})
    assert batch.prompt_tokens == 3 * one
    ids = pool.features({"model": "m", "prompt": [[1, 2, 3, 4], [5, 6]]}, "completions", "r", {})
    assert ids.prompt_tokens == 6
    flat = pool.features({"model": "m", "prompt": list(range(300))}, "completions", "r", {})
    assert flat.prompt_tokens == 300 and sum(flat.block_tokens) <= 300
    emb = pool.features({"model": "m", "input": ["a b", "c d", "e f"]}, "embeddings", "r", {})
    assert emb.prompt_tokens == 6


async def test_tokenize_needs_no_model_only_when_one_name_is_served(gen_sim, gateway) -> None:  # type: ignore[no-untyped-def]
    """As in vLLM, `/tokenize` may leave `model` out when the gateway serves one model under one
    name: one pool and no routes. A route is a second name for it, so the default config (pool
    `meta-llama/...` behind the route `llama`) needs `model` (docs/api.md)."""
    route = [{"model": "llama", "rules": [{"pools": [{"name": "p"}]}]}]
    one = await gateway(gateway_settings([gen_sim], pool={"served_model": "internal-fp8"}))
    aliased = await gateway(gateway_settings([gen_sim], pool={"served_model": "internal-fp8"}, routes=route))
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(one.url + "/tokenize", json={"prompt": "hello world"})
        assert r.status_code == 200 and r.json()["count"] == 2, r.text
        r = await c.post(aliased.url + "/tokenize", json={"prompt": "hello world"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "missing_model", r.text
