"""The continuation's state machine (gateway/path/resume.py) on events written by hand: the body it
asks for, the seam it trims, and what it refuses. End to end: test_resume_property.py (simulator),
test_resume_hostile.py (every way a stream breaks), test_resume_pd.py."""

from __future__ import annotations

import orjson

from gateway.config import FailoverConfig
from gateway.fleet.engines import VLLMAdapter
from gateway.path.resume import Resume, word_boundary

CONTINUE = VLLMAdapter().continuation  # vLLM's (and SGLang's) way to continue an answer


def _chat_event(content: str, finish: str | None = None, role: bool = False) -> bytes:
    delta = {"role": "assistant", "content": content} if role else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    doc = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _resume(**body: object) -> Resume:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10}
    return Resume(
        "chat", {**base, **body}, FailoverConfig(), lambda text: len(text.split()), 1 << 20, CONTINUE
    )


def test_word_boundary_leaves_the_last_word_to_regenerate() -> None:
    assert word_boundary(" the of an") == len(" the of")
    assert word_boundary(" the of ") == len(" the")  # the last word stays in the seam with its space
    assert word_boundary(" the of \n ") == len(" the")
    assert word_boundary("one") == 0 and word_boundary("") == 0


def test_a_chat_continuation_opens_the_final_assistant_message_and_shrinks_max_tokens() -> None:
    r = _resume(stop=["x"], seed=3)
    r.feed(_chat_event("", role=True) + _chat_event(" the") + _chat_event(" of an"))
    doc = r.continuation()
    assert doc["messages"][-1] == {"role": "assistant", "content": " the of"}
    assert doc["continue_final_message"] is True and doc["add_generation_prompt"] is False
    assert doc["max_tokens"] == 8 and doc["stop"] == ["x"] and doc["seed"] == 3
    assert r.body["messages"] == [{"role": "user", "content": "hi"}]  # the original, untouched


def test_a_completion_continuation_extends_the_prompt() -> None:
    r = Resume("completions", {"prompt": "p", "stream": True}, FailoverConfig(), len, 1 << 20, CONTINUE)
    event = {"id": "cmpl-1", "created": 1, "model": "m", "choices": [{"index": 0, "text": " a bc"}]}
    r.feed(b"data: " + orjson.dumps(event) + b"\n\n")
    assert r.continuation()["prompt"] == "p a"


def test_the_seam_is_trimmed_and_the_first_attempts_ids_kept() -> None:
    r = _resume()
    r.feed(_chat_event("", role=True) + _chat_event(" the of an"))
    r.continuation()
    later = _chat_event("", role=True).replace(b"chatcmpl-1", b"chatcmpl-2") + _chat_event(" a").replace(
        b"chatcmpl-1", b"chatcmpl-2"
    )
    assert r.feed(later) == b""  # the repeated role, then part of the seam: nothing to relay
    out = r.feed(_chat_event("nd more", "length").replace(b"chatcmpl-1", b"chatcmpl-2"))
    doc = orjson.loads(out.removeprefix(b"data: "))
    assert doc["id"] == "chatcmpl-1" and doc["created"] == 7
    assert doc["choices"][0]["delta"] == {"content": "d more"}  # what extends " an"
    assert "".join(r.text) == " the of and more"


def test_an_engine_that_drops_the_space_before_the_seam_still_matches() -> None:
    r = _resume()
    r.feed(_chat_event(" the of"))
    r.continuation()
    out = r.feed(_chat_event("of then"))
    assert orjson.loads(out.removeprefix(b"data: "))["choices"][0]["delta"]["content"] == " then"


def test_a_continuation_that_disagrees_with_the_text_sent_ends_the_answer() -> None:
    r = _resume()
    r.feed(_chat_event(" the of"))
    r.continuation()
    assert r.feed(_chat_event(" if so")) == b""
    assert r.failure == "diverged" and not r.continuable
    assert r.error_event is not None and b"upstream_resume_diverged" in r.error_event


def test_a_tool_call_being_streamed_cannot_be_continued() -> None:
    r = _resume()
    call = {"index": 0, "function": {"arguments": "{"}}
    doc = {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
    r.feed(b"data: " + orjson.dumps(doc) + b"\n\n")
    assert r.blocked == "tool_call" and not r.continuable


def test_usage_after_a_continuation_counts_the_whole_answer() -> None:
    r = _resume()
    r.feed(_chat_event(" the of an"))
    r.continuation()  # starts from " the of": 2 tokens
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    usage_event = {"id": "x", "created": 1, "model": "m", "choices": [], "usage": usage}
    out = r.feed(b"data: " + orjson.dumps(usage_event) + b"\n\n")
    assert orjson.loads(out.removeprefix(b"data: "))["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
    }


def _kept_bytes(r: Resume) -> int:
    return sum(len(part) for part in r.text) + sum(len(part) for part in r.reasoning)


def test_a_streamed_answer_past_max_kept_bytes_keeps_nothing_and_is_no_longer_continuable() -> None:
    r = Resume(
        "chat",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        FailoverConfig(max_kept_bytes=4096),
        len,
        1 << 20,
        CONTINUE,
    )
    r.feed(_chat_event("", role=True))
    event = _chat_event("x" * 100)
    relayed = b"".join(r.feed(event) for _ in range(1000))  # ~140 KB, 34x the bound
    assert relayed == event * 1000  # relayed untouched all the same
    assert _kept_bytes(r) == 0 and not r.continuable and r.blocked == "too_long"
    r.feed(b"data: [DONE]\n\n")
    assert r.done and r.whole  # its end is still seen


def test_below_the_bound_the_answer_stays_continuable() -> None:
    r = _resume()
    r.feed(_chat_event("", role=True) + _chat_event(" the of an"))
    assert r.continuable and r.sent_text() == " the of an"


def test_an_assembled_answer_past_max_response_bytes_fails_the_attempt() -> None:
    r = Resume(
        "chat",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},  # not streamed: assembled
        FailoverConfig(non_streamed=True),
        len,
        4096,
        CONTINUE,
    )
    r.feed(_chat_event("", role=True))
    for _ in range(100):
        if r.failure is not None:
            break
        assert r.feed(_chat_event("x" * 100)) == b""
    assert r.failure == "too_large" and not r.continuable


def test_a_continuation_that_starts_over_after_text_ending_in_a_space_is_caught() -> None:
    """Issue 35: the text sent ended in whitespace, the seam was whitespace alone, and a
    continuation that ignored continue_final_message and started over was relayed in full."""
    r = _resume()
    r.feed(_chat_event("", role=True) + _chat_event(" the cat sat "))
    doc = r.continuation()
    assert doc["messages"][-1]["content"] == " the cat"  # " sat " is regenerated, and checked
    restarted = _chat_event(" the").replace(b"chatcmpl-1", b"chatcmpl-2") + _chat_event(" cat")
    assert r.feed(restarted) == b"" and r.failure == "diverged"
    assert r.error_event is not None and b"upstream_resume_diverged" in r.error_event


def test_a_continuation_that_goes_on_after_text_ending_in_a_space_is_relayed_once() -> None:
    r = _resume()
    r.feed(_chat_event("", role=True) + _chat_event(" the cat sat "))
    r.continuation()
    went_on = _chat_event(" sat").replace(b"chatcmpl-1", b"chatcmpl-2") + _chat_event(" down")
    out = r.feed(went_on)
    assert r.failure is None and b'"content":"down"' in out and b" sat" not in out
