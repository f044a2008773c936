"""The "window" policy for prompts over their size limit: keep the system prompt, drop the oldest turns.

Leading system/developer messages (and tools) are kept whole because they carry the instructions and the
shared, cacheable prefix; the newest turn (from the last user message on) is always kept because it is the
question being asked. Turns are dropped oldest first, a user message together with the assistant/tool
messages answering it, so that the conversation never starts with an orphaned tool result. Counts use
the same serialization and tokenizer as the request's features (gateway.prompt.prefix_hash), so the limit
means the same thing everywhere.
"""

from __future__ import annotations

from typing import Any

from gateway.prompt.endpoints import BY_NAME, Endpoint
from gateway.prompt.prefix_hash import message_text, prompt_text
from gateway.prompt.tokens import count_tokens

_KEPT_ROLES = frozenset({"system", "developer"})


def _turns(messages: list[Any], start: int) -> list[tuple[int, int]]:
    """[start, end) spans of messages[start:], each beginning at a user message (or the first message)."""
    spans: list[tuple[int, int]] = []
    begin = start
    for i in range(start + 1, len(messages)):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == "user":
            spans.append((begin, i))
            begin = i
    if begin < len(messages):
        spans.append((begin, len(messages)))
    return spans


def fit_window(body: dict[str, Any], endpoint: Endpoint, limit: int) -> int | None:
    """Trim `body`'s conversation in place to at most `limit` prompt tokens.

    Returns the new prompt size, or None when it cannot fit (not a conversation, or the kept system
    prompt plus the newest turn alone exceed the limit); the body is left unchanged then.
    """
    key = BY_NAME[endpoint].conversation
    if key is None or not isinstance(messages := body.get(key), list) or not messages:
        return None
    head = 0
    while head < len(messages) - 1 and isinstance(messages[head], dict):
        if messages[head].get("role") not in _KEPT_ROLES:
            break
        head += 1
    spans = _turns(messages, head)
    # Where the kept conversation may start, least trimming first: at each turn boundary. The newest
    # turn is kept whole (a tool result without the call that asked for it is meaningless).
    cuts = [s for s, _ in spans]
    sizes = [count_tokens(message_text(m)) for m in messages]
    fixed = count_tokens(prompt_text({**body, key: messages[:head]}, endpoint))
    kept = sum(sizes[head:])
    dropped_to = head
    for cut in cuts:
        kept -= sum(sizes[dropped_to:cut])
        dropped_to = cut
        if fixed + kept > limit:
            continue
        trimmed = messages[:head] + messages[cut:]
        # The per-message estimate can be off by a token at message boundaries: confirm on the whole.
        total = count_tokens(prompt_text({**body, key: trimmed}, endpoint))
        if total <= limit:
            break
    else:
        return None
    body[key] = trimmed
    return total
