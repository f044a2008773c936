"""The window policy: the system prompt and the newest turns stay, the oldest turns go."""

from __future__ import annotations

from typing import Any

from gateway.prompt.prefix_hash import prompt_text
from gateway.prompt.tokens import count_tokens
from gateway.prompt.window import fit_window


def _conversation(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. " * 5}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i} " + "filler " * 10})
        msgs.append(
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function"}]}
        )
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"})
        msgs.append({"role": "assistant", "content": f"answer {i}"})
    msgs.append({"role": "user", "content": "and now?"})
    return msgs


def test_keeps_system_and_newest_turns_and_fits() -> None:
    msgs = _conversation(8)
    body = {"model": "m", "messages": list(msgs)}
    full = count_tokens(prompt_text(body, "chat"))
    limit = full // 2
    total = fit_window(body, "chat", limit)
    kept = body["messages"]
    assert total is not None and total <= limit
    assert total == count_tokens(prompt_text(body, "chat"))
    assert kept[0] == msgs[0] and kept[-1] == msgs[-1]
    assert kept[1]["role"] == "user"  # whole turns only: no orphaned tool result first
    assert kept[1:] == msgs[len(msgs) - len(kept) + 1 :]
    # As much history as fits: one more turn would not have.
    one_more = msgs[:1] + msgs[len(msgs) - len(kept) - 3 :]
    assert count_tokens(prompt_text({"messages": one_more}, "chat")) > limit


def test_unfittable_or_not_a_conversation_is_left_alone() -> None:
    msgs = _conversation(2)
    body = {"model": "m", "messages": list(msgs)}
    assert fit_window(body, "chat", 5) is None  # the system prompt alone is larger
    assert body["messages"] == msgs
    assert fit_window({"model": "m", "prompt": "x " * 100}, "completions", 5) is None


def test_responses_input_list() -> None:
    items = [{"role": "user", "content": "old " * 50}, {"role": "user", "content": "new"}]
    body = {"model": "m", "instructions": "be kind", "input": list(items)}
    assert fit_window(body, "responses", 20) is not None
    assert body["input"] == items[1:]
