"""Property: with greedy decoding, an answer broken at any byte and continued on another replica is
the uninterrupted answer, token for token (chat and completions, streamed and not, with and
without stop strings).

Two simulated replicas, each behind a relay (tests/cut_relay.py) that resets the connection once
the armed number of answer bytes passed; a real gateway in front of the relays. Hypothesis picks
the endpoint, streaming, the prompt's size, max_tokens, a stop string and the byte at which the
answer breaks.
The gateway and relays run on a loop of their own thread, so hypothesis drives plain calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.server import RunningGateway, start_gateway
from tests.conftest import gateway_settings
from tests.cut_relay import CutRelay, Trigger
from tests.simfleet import sim_fleet

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


class _Stack:
    """The gateway and the relays, on an event loop in a thread of their own."""

    def __init__(self, urls: list[str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.trigger = Trigger()
        self.relays = [self.call(CutRelay(u, self.trigger).start()) for u in urls]
        settings_ = gateway_settings(
            [r.url for r in self.relays],
            health={"enabled": False},
            # Every other request here breaks: a budget for one retry (or resume) per request.
            retry={"budget_ratio": 1.0},
            breaker={"failure_threshold": 1000},  # nor is a replica held to blame for it
            pool={"policy": {"type": "round_robin"}, "failover": {"non_streamed": True}},
        )
        self.gw: RunningGateway = self.call(start_gateway(settings_))

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self.call(self.gw.stop())
        for r in self.relays:
            self.call(r.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[_Stack]:
    # A module's fixture, started while other modules' processes may load the machine.
    with sim_fleet(replicas=2, speedup=50.0) as fleet:
        s = _Stack(fleet.urls)
        try:
            yield s
        finally:
            s.close()


def ask(
    client: httpx.Client, chat: bool, stream: bool, prompt: str, max_tokens: int, stop: str | None = None
) -> dict[str, Any]:
    """The answer as the client saw it: text, finish reason, usage, ids, and whether it broke."""
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stop is not None:
        body["stop"] = [stop]
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    if not stream:
        doc = r.json()
        choice = doc["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        finish = (choice["finish_reason"], choice.get("stop_reason"))
        return {"text": text, "finish": finish, "usage": doc["usage"], "ids": {doc["id"]}}
    out: dict[str, Any] = {"text": "", "finish": None, "usage": None, "ids": set(), "roles": 0}
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", events[-3:]
    for e in events[:-1]:
        doc = orjson.loads(e.removeprefix("data: "))
        assert "error" not in doc, doc
        out["ids"].add((doc["id"], doc["created"], doc["model"]))
        if doc.get("usage"):
            out["usage"] = doc["usage"]
        for c in doc["choices"]:
            assert c["index"] == 0
            if chat:
                out["roles"] += "role" in c["delta"]
                out["text"] += c["delta"].get("content") or ""
            else:
                out["text"] += c["text"]
            if c["finish_reason"] is not None:
                out["finish"] = (c["finish_reason"], c.get("stop_reason"))
    assert out["roles"] <= 1, "the role was sent twice"
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chat=st.booleans(),
    stream=st.booleans(),
    words=st.integers(1, 400),
    max_tokens=st.integers(1, 48),
    cut_at=st.integers(0, 3000),
    # A stop string cut from the answer itself (where and how long), so that it is met.
    stop=st.none() | st.tuples(st.integers(0, 400), st.integers(1, 7)),
)
def test_continued_answer_is_the_uninterrupted_one(
    stack: _Stack,
    chat: bool,
    stream: bool,
    words: int,
    max_tokens: int,
    cut_at: int,
    stop: tuple[int, int] | None,
) -> None:
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(words))
    with httpx.Client(base_url=stack.gw.url, timeout=60) as client:
        stack.trigger.disarm()
        stop_string = None
        if stop is not None:
            text = ask(client, chat, False, prompt, max_tokens)["text"]
            at = stop[0] % len(text)
            stop_string = text[at : at + stop[1]]
        whole = ask(client, chat, stream, prompt, max_tokens, stop_string)
        stack.trigger.arm(cut_at)
        broken = ask(client, chat, stream, prompt, max_tokens, stop_string)
        stack.trigger.disarm()
    assert broken["text"] == whole["text"]
    assert broken["finish"] == whole["finish"]
    assert broken["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert broken["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert len(broken["ids"]) == 1  # one id, created and model across the seam


def test_some_answers_were_really_cut(stack: _Stack) -> None:
    """The property above is not vacuous: a cut inside a streamed answer is continued."""
    prompt = " ".join(WORDS * 5)
    with httpx.Client(base_url=stack.gw.url, timeout=60) as client:
        whole = ask(client, True, True, prompt, 40)
        before = stack.trigger.fired
        stack.trigger.arm(1200)  # past the head and the first events, well before the end
        broken = ask(client, True, True, prompt, 40)
        metrics = client.get(stack.gw.url + "/metrics").text
    assert stack.trigger.fired == before + 1
    assert broken["text"] == whole["text"]
    # The same counts; only the cached share differs (the continuation found the prompt cached).
    figures = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [broken["usage"][k] for k in figures] == [whole["usage"][k] for k in figures]
    assert 'kvgate_resumed_total{pool="p",reason="disconnected"}' in metrics
