"""Continuing an answer, as vLLM and SGLang take it: `continue_final_message` renders the final
(assistant) message open, a completion prompt simply grows, and greedy generation goes on exactly
as the uninterrupted answer did; stop strings end the text before their match (stop_reason names
it) and are never streamed in part."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.sim.conftest import cli_replica

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("api", ["vllm", "sglang"])
async def test_a_continued_chat_answer_goes_on_as_the_uninterrupted_one(api: str) -> None:
    async with cli_replica("--api", api) as url, httpx.AsyncClient(base_url=url) as c:
        whole = (await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12})).json()
        text = whole["choices"][0]["message"]["content"]
        words = text.split(" ")[1:]
        sent = "".join(" " + w for w in words[:5])
        body = {
            "messages": [*MESSAGES, {"role": "assistant", "content": sent}],
            "max_tokens": 7,
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        rest = (await c.post("/v1/chat/completions", json=body)).json()
    assert sent + rest["choices"][0]["message"]["content"] == text
    # The open message's tokens are the prompt's: the counts add up to the uninterrupted ones.
    assert rest["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + 5


async def test_a_grown_completion_prompt_continues_the_text() -> None:
    async with cli_replica() as url, httpx.AsyncClient(base_url=url) as c:
        text = (await c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 10})).json()
        text = text["choices"][0]["text"]
        head = "".join(" " + w for w in text.split(" ")[1:4])
        rest = (await c.post("/v1/completions", json={"prompt": "Once" + head, "max_tokens": 7})).json()
    assert head + rest["choices"][0]["text"] == text


async def test_both_switches_on_is_refused_as_vllm_does() -> None:
    async with cli_replica() as url, httpx.AsyncClient(base_url=url) as c:
        body = {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert (
        "Cannot set both `continue_final_message` and `add_generation_prompt`" in r.json()["error"]["message"]
    )


async def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed_in_part() -> None:
    async with cli_replica() as url, httpx.AsyncClient(base_url=url) as c:
        text = (await c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 16})).json()
        text = text["choices"][0]["text"]
        stop = text[9:14]
        body = {"prompt": "Once", "max_tokens": 16, "stop": [stop], "stream": True}
        r = await c.post("/v1/completions", json=body)
    events = [orjson.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and "[DONE]" not in e]
    choices = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == text[: text.index(stop)]
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == ("stop", stop)
    # Held back while it ran: the word in which the match begins (each output word starts with its
    # space), so that an answer continued from what was streamed regenerates it.
    at = text.index(stop)
    assert len("".join(c["text"] for c in choices[:-1])) <= text.rindex(" ", 0, at + 1)
