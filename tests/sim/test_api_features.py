"""The simulator's vLLM API features, driven by the openai SDK (and httpx where the SDK has no call) against
simulator processes on loopback: logprobs, structured outputs, forced tool calls, batched prompts, LoRA
adapters, embeddings and the other pooling endpoints, tokenize/detokenize, the Responses API."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import openai
import pytest

from tests.sim.conftest import TOOL, cli_replica
from tests.simfleet import sim_process

MSGS = [
    {"role": "system", "content": "Answer in JSON. " * 20},
    {"role": "user", "content": "Weather in Oslo?"},
]
SCHEMA = TOOL["function"]["parameters"]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _check_ranked(values: list[float]) -> None:
    assert all(v <= 0 for v in values) and values == sorted(values, reverse=True)
    assert math.fsum(math.exp(v) for v in values) < 1


async def test_chat_logprobs_streamed_and_not(strict_sim: str) -> None:
    c = client(strict_sim)
    full = await c.chat.completions.create(
        model="m",
        messages=MSGS,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        seed=7,  # type: ignore[arg-type]
    )
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == full.choices[0].message.content
    for t in content:
        assert t.top_logprobs[0].token == t.token and len(t.top_logprobs) == 3
        assert t.bytes == list(t.token.encode())
        _check_ranked([a.logprob for a in t.top_logprobs])
    stream = await c.chat.completions.create(
        model="m",
        messages=MSGS,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        seed=7,
        stream=True,  # type: ignore[arg-type]
    )
    streamed = [t for ch in [x async for x in stream] if ch.choices for t in ch.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = await c.chat.completions.create(model="m", messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


async def test_completion_logprobs_layout(strict_sim: str) -> None:
    c = client(strict_sim)
    r = await c.completions.create(model="m", prompt="one two three", max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == r.choices[0].text
    offsets = [0]
    for tok in (lp.tokens or [])[:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp.text_offset == offsets
    for tok, value, top in zip(lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
        assert len(top) == 3 and top[tok] == value == max(top.values())  # the sampled token and 2 more
        _check_ranked(sorted(top.values(), reverse=True))


async def test_response_format_json_object_schema_and_truncation(strict_sim: str) -> None:
    c = client(strict_sim)
    obj = await c.chat.completions.create(
        model="m",
        messages=MSGS,
        response_format={"type": "json_object"},
        max_tokens=200,  # type: ignore[arg-type]
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    assert obj.choices[0].finish_reason == "stop"
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    for seed in range(4):
        r = await c.chat.completions.create(
            model="m",
            messages=MSGS,
            response_format=rf,
            seed=seed,
            max_tokens=300,  # type: ignore[arg-type]
        )
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
        assert r.choices[0].finish_reason == "stop" and r.usage and r.usage.completion_tokens < 300
    cut = await c.chat.completions.create(model="m", messages=MSGS, response_format=rf, seed=3, max_tokens=5)  # type: ignore[arg-type]
    assert cut.choices[0].finish_reason == "length" and cut.usage and cut.usage.completion_tokens == 5
    assert (r.choices[0].message.content or "").startswith(cut.choices[0].message.content or "-")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content or "")
    comp = await c.completions.create(
        model="m", prompt="{", max_tokens=300, extra_body={"response_format": rf}
    )
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)


async def test_forced_tool_calls_named_and_required_streamed_and_not(strict_sim: str) -> None:
    c = client(strict_sim)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = await c.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=[TOOL],
        tool_choice=named,
        max_tokens=300,  # type: ignore[arg-type]
    )
    msg = r.choices[0].message
    assert msg.content == "" and r.choices[0].finish_reason == "stop"  # vLLM: "stop" for a named function
    (call,) = msg.tool_calls or []
    assert (
        call.type == "function"
        and call.function.name == "get_weather"
        and call.id.startswith("chatcmpl-tool-")
    )  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)  # type: ignore[union-attr]

    stream = await c.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=300,
        stream=True,  # type: ignore[arg-type]
    )
    deltas = [ch.choices[0] for ch in [x async for x in stream] if ch.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    first, rest = calls[0], calls[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"  # type: ignore[union-attr]
    assert rest and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)  # type: ignore[union-attr]
    arguments = "".join(d.function.arguments or "" for d in calls)  # type: ignore[union-attr]
    jsonschema.validate(json.loads(arguments), SCHEMA)
    assert arguments == call.function.arguments  # type: ignore[union-attr]  # same prompt, same seed
    assert deltas[-1].finish_reason == "tool_calls" and all(d.delta.content is None for d in deltas)

    cut = await c.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=[TOOL],
        tool_choice=named,
        max_tokens=3,  # type: ignore[arg-type]
    )
    assert cut.choices[0].finish_reason == "length"
    assert call.function.arguments.startswith(cut.choices[0].message.tool_calls[0].function.arguments)  # type: ignore[union-attr,index]
    auto = await c.chat.completions.create(model="m", messages=MSGS, tools=[TOOL], max_tokens=4)  # type: ignore[arg-type]
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content


async def test_auto_tool_choice_calls_a_tool_the_user_names(strict_sim: str) -> None:
    """As vLLM's hermes parser reports a model's `<tool_call>`: content null, the call at index 0,
    finish_reason "tool_calls"; after the tool's answer the model answers in text."""
    c = client(strict_sim)
    asked = [{"role": "user", "content": "Call get_weather for Oslo, please."}]
    r = await c.chat.completions.create(model="m", messages=asked, tools=[TOOL], max_tokens=300)  # type: ignore[arg-type]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)  # type: ignore[union-attr]

    stream = await c.chat.completions.create(
        model="m",
        messages=asked,
        tools=[TOOL],
        tool_choice="auto",
        max_tokens=300,
        stream=True,  # type: ignore[arg-type]
    )
    deltas = [ch.choices[0] for ch in [x async for x in stream] if ch.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].function.name == "get_weather" and {d.index for d in calls} == {0}  # type: ignore[union-attr]
    assert "".join(d.function.arguments or "" for d in calls) == call.function.arguments  # type: ignore[union-attr]
    assert deltas[-1].finish_reason == "tool_calls"

    answered = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"},
    ]
    after = await c.chat.completions.create(model="m", messages=answered, tools=[TOOL], max_tokens=4)  # type: ignore[arg-type]
    assert after.choices[0].message.tool_calls is None and after.choices[0].message.content
    assert after.choices[0].finish_reason == "length"


async def test_batched_completion_prompts(strict_sim: str) -> None:
    c = client(strict_sim)
    single = [
        await c.completions.create(model="m", prompt=p, max_tokens=3, n=2) for p in ("alpha beta", "gamma")
    ]
    batch = await c.completions.create(model="m", prompt=["alpha beta", "gamma"], max_tokens=3, n=2)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in batch.choices] == [ch.text for r in single for ch in r.choices]
    assert batch.usage and batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in single)  # type: ignore[union-attr]
    assert batch.usage.completion_tokens == 12
    ids = await c.completions.create(model="m", prompt=[[11, 12, 13], [14, 15]], max_tokens=2)
    assert ids.usage and ids.usage.prompt_tokens == 5 and len(ids.choices) == 2
    stream = await c.completions.create(
        model="m",
        prompt=["alpha beta", "gamma"],
        max_tokens=3,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    async for ch in stream:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [ch.text for ch in batch.choices]


async def test_lora_adapters_listing_routing_cache_and_admin(strict_sim: str) -> None:
    c = client(strict_sim)
    cards = {m.id: m.model_dump() for m in (await c.models.list()).data}
    assert (
        cards["m"]["parent"] is None
        and cards["m"]["max_model_len"] == 4096
        and cards["m"]["owned_by"] == "vllm"
    )
    assert cards["sql"]["parent"] == "m" and cards["sql"]["root"] == "/adapters/sql"
    assert cards["chat"]["root"] == "/adapters/chat" and cards["chat"]["max_model_len"] is None
    msgs = [{"role": "user", "content": "shared prefix for every adapter. " * 40}]
    base = await c.chat.completions.create(model="m", messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    sql1 = await c.chat.completions.create(model="sql", messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    sql2 = await c.chat.completions.create(model="sql", messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    assert base.model == "m" and sql1.model == "sql"
    # Blocks of different adapters never match: the adapter's first request misses what the base cached.
    assert sql1.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert sql2.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    async with httpx.AsyncClient(base_url=strict_sim) as h:
        assert (
            await h.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/a/new"})
        ).text == ("Success: LoRA adapter 'new' added successfully.")
        again = await h.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/a/new"})
        assert again.status_code == 400 and again.json()["error"]["type"] == "InvalidUserInput"
        served = await c.completions.create(model="new", prompt="hello", max_tokens=2)
        assert served.model == "new"
        metrics = (await h.get("/metrics")).text
        assert (
            'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}'
            in metrics
        )
        lora_state = (await h.get("/sim/state")).json()["lora"]
        assert lora_state["swaps"] >= 2 and lora_state["gpu_slots"] == ["new"]  # --max-loras 1: one resident
        gone = await h.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert gone.text == "Success: LoRA adapter 'new' removed successfully."
        missing = await h.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        await c.completions.create(model="new", prompt="hello", max_tokens=2)


async def test_runtime_lora_endpoints_need_the_env_variable() -> None:
    async with cli_replica() as plain, httpx.AsyncClient(base_url=plain) as h:
        r = await h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        assert "vllm:lora_requests_info" not in (await h.get("/metrics")).text


async def test_embeddings_and_pooling_endpoints(strict_sim: str) -> None:
    async with cli_replica("--runner", "pooling", "--embedding-dim", "256") as pooling_sim:
        await _pooling(pooling_sim)
    async with httpx.AsyncClient(base_url=strict_sim) as h:
        assert (await h.post("/v1/embeddings", json={"model": "m", "input": "x"})).status_code == 404


async def _pooling(pooling_sim: str) -> None:
    c = client(pooling_sim)
    texts = ["the cat sat on the mat", "the cat sat on a mat", "quarterly revenue grew"]
    b64 = await c.embeddings.create(model="m", input=texts)  # the SDK asks for base64 and decodes it
    floats = await c.embeddings.create(model="m", input=texts, encoding_format="float")
    vecs = [d.embedding for d in floats.data]
    assert [len(v) for v in vecs] == [256] * 3 and all(
        abs(math.fsum(x * x for x in v) - 1) < 1e-9 for v in vecs
    )
    assert all(
        a == pytest.approx(b, abs=1e-6)
        for d, e in zip(b64.data, floats.data, strict=True)
        for a, b in zip(d.embedding, e.embedding, strict=True)
    )
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    sim = [math.fsum(a * b for a, b in zip(vecs[0], v, strict=True)) for v in vecs[1:]]
    assert sim[0] > sim[1]  # shared words, closer vectors
    again = await c.embeddings.create(model="m", input=texts[0], encoding_format="float", dimensions=64)
    head = vecs[0][:64]
    norm = math.sqrt(math.fsum(x * x for x in head))
    assert again.data[0].embedding == pytest.approx([x / norm for x in head])
    async with httpx.AsyncClient(base_url=pooling_sim) as h:
        rerank = (
            await h.post("/rerank", json={"model": "m", "query": texts[0], "documents": texts[1:]})
        ).json()
        assert [x["index"] for x in rerank["results"]] == [0, 1]
        score = (await h.post("/score", json={"model": "m", "text_1": texts[0], "text_2": texts[1:]})).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(sim)
        pooled = (await h.post("/pooling", json={"model": "m", "input": texts[0]})).json()
        assert pooled["data"][0]["data"] == pytest.approx(vecs[0])
        generate = await h.post("/v1/chat/completions", json={"model": "m", "messages": MSGS})
        assert generate.status_code == 404 and generate.json() == {"detail": "Not Found"}


async def test_rerank_and_score_are_meaningful_and_deterministic() -> None:
    """A query that shares no token with any document (cl100k splits `capitals` and `capital`
    differently) used to score 0.0 against all of them; sharing parts of words now ranks a document
    first, and two simulator processes give the same scores for the same request."""
    body = {
        "model": "m",
        "query": "Which capitals border France?",
        "documents": ["banana bread recipe", "Paris, capital city", "quarterly revenue grew"],
    }
    answers = []
    for _ in range(2):
        with sim_process("m", "--runner", "pooling") as url:
            async with httpx.AsyncClient(base_url=url) as h:
                rerank = (await h.post("/rerank", json=body)).json()["results"]
                pair = {"model": "m", "text_1": body["query"], "text_2": body["documents"]}
                score = (await h.post("/score", json=pair)).json()["data"]
        answers.append((rerank, score))
    assert answers[0] == answers[1]  # deterministic, across processes
    rerank, score = answers[0]
    assert rerank[0]["index"] == 1 and rerank[0]["relevance_score"] > 0.05
    assert all(r["relevance_score"] < rerank[0]["relevance_score"] for r in rerank[1:])
    assert {r["index"]: r["relevance_score"] for r in rerank} == {d["index"]: d["score"] for d in score}


async def test_tokenize_detokenize_and_responses(strict_sim: str) -> None:
    c = client(strict_sim)
    async with httpx.AsyncClient(base_url=strict_sim) as h:
        tok = (
            await h.post("/tokenize", json={"model": "m", "prompt": "hello world", "return_token_strs": True})
        ).json()
        assert tok["count"] == len(tok["tokens"]) and "".join(tok["token_strs"]) == "hello world"
        assert tok["max_model_len"] == 4096
        back = (await h.post("/detokenize", json={"model": "m", "tokens": tok["tokens"]})).json()
        assert back == {"prompt": "hello world"}
        chat = (await h.post("/tokenize", json={"model": "m", "messages": MSGS})).json()
    r = await c.chat.completions.create(model="m", messages=MSGS, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage and chat["count"] == r.usage.prompt_tokens
    resp = await c.responses.create(
        model="m", input="Say something.", instructions="Be brief.", max_output_tokens=6
    )
    assert resp.status == "incomplete" and resp.usage and resp.usage.output_tokens == 6
    assert resp.output_text and resp.model == "m"
    stream = await c.responses.create(
        model="m", input="Say something.", instructions="Be brief.", max_output_tokens=6, stream=True
    )
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text  # type: ignore[union-attr]
