"""The OpenAI wire format of the simulator: chat template, deterministic output text, response bodies, errors.

Generated text is a fixed cycle of common English words, each a single cl100k token with its leading space, so
`completion_tokens` equals the number of words and a re-tokenizing client counts the same. Chunks are built
from pre-encoded byte pieces because a streaming step writes one chunk per running request.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import orjson

from gateway.prompt.tokens import get_tokenizer

_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or have an not but which one all "
    "were they we can has more will their if so about when would there what out up other some into its time "
    "only no new like then than also these two may first way any could after most over such made where "
    "my many through each how very"
).split()
VOCAB = [" " + w for w in _WORDS]
_VOCAB_JSON = [orjson.dumps(w)[1:-1] for w in VOCAB]
_STRIDE = 7  # coprime with len(VOCAB): the cycle visits every word


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """A simple deterministic template: tools as JSON first, then per message a role marker and content.

    `continue_final_message` leaves the last message open, its end-of-turn dropped, so that generation
    extends it: what vLLM's Hugging Face rendering does (the text cut right after the final message's
    content) and what SGLang's gives (the template without that message, its generation prompt, then
    the message's content)."""
    parts: list[str] = []
    if tools:
        parts.append("<|tools|>\n" + orjson.dumps(tools).decode() + "\n")
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p if isinstance(p, str) else _part_text(p) for p in content)
        elif not isinstance(content, str):
            content = ""
        if m.get("tool_calls"):
            content += orjson.dumps(m["tool_calls"]).decode()
        parts.append(f"<|{m.get('role', 'user')}|>\n{content}\n")
    if continue_final_message and parts:
        parts[-1] = parts[-1][:-1]
    elif add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _part_text(part: Any) -> str:
    text = part.get("text") if isinstance(part, dict) else None
    return text if isinstance(text, str) else ""


def output_seed(prompt: list[int], index: int, seed: int | None) -> int:
    """Where choice `index`'s walk through the word cycle starts. A prompt that ends in an output word
    (an answer being continued) takes the cycle's next word, whatever the seed: greedy decoding is a
    function of the context, so a continued answer goes on exactly as the uninterrupted one would."""
    if prompt and (word := _word_positions().get(prompt[-1])) is not None:
        return (word + _STRIDE + index) % len(VOCAB)
    return ((seed or 0) * 31 + len(prompt) * 13 + index) % len(VOCAB)


def output_text(seed: int, start: int, end: int) -> str:
    n = len(VOCAB)
    return "".join(VOCAB[(seed + k * _STRIDE) % n] for k in range(start, end))


@lru_cache(maxsize=1)
def vocab_token_ids() -> tuple[int, ...] | None:
    """The token id of each output word; None when the tokenizer does not see each as one token (the
    byte-level fallback), since output blocks then cannot be hashed the way a next turn's prompt is."""
    ids = [get_tokenizer().encode(w) for w in VOCAB]
    return tuple(i[0] for i in ids) if all(len(i) == 1 for i in ids) else None


@lru_cache(maxsize=1)
def _word_positions() -> dict[int, int]:
    """Each output word's place in the vocabulary, by its token id."""
    return {t: i for i, t in enumerate(vocab_token_ids() or ())}


def output_token_ids(seed: int, start: int, end: int) -> list[int]:
    ids = vocab_token_ids()
    assert ids is not None
    n = len(ids)
    return [ids[(seed + k * _STRIDE) % n] for k in range(start, end)]


def output_words(seed: int, start: int, end: int) -> list[str]:
    n = len(VOCAB)
    return [VOCAB[(seed + k * _STRIDE) % n] for k in range(start, end)]


def output_json(seed: int, start: int, end: int) -> bytes:
    n = len(VOCAB)
    return b'"' + b"".join(_VOCAB_JSON[(seed + k * _STRIDE) % n] for k in range(start, end)) + b'"'


class ChunkFormat:
    """Byte templates for one response's SSE chunks (chat or text completion)."""

    __slots__ = ("_head", "_mid", "chat", "seeds")

    def __init__(self, chat: bool, resp_id: str, model: str, created: int, seeds: list[int]) -> None:
        self.chat = chat
        self.seeds = seeds
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = orjson.dumps({"id": resp_id, "object": obj, "created": created, "model": model})[:-1]
        self._mid = b',"choices":[{"index":'

    def piece(self, index: int, start: int, end: int, finish: str | None) -> bytes:
        """The chunk of choice `index`'s output tokens [start, end)."""
        content = output_json(self.seeds[index], start, end)
        fin = b"null" if finish is None else b'"' + finish.encode() + b'"'
        if self.chat:
            role = b'"role":"assistant",' if start == 0 else b""
            body = (
                b',"delta":{' + role + b'"content":' + content + b'},"logprobs":null,"finish_reason":' + fin
            )
        else:
            body = b',"text":' + content + b',"logprobs":null,"finish_reason":' + fin + b',"stop_reason":null'
        return b"data: " + self._head + self._mid + str(index).encode() + body + b"}]}\n\n"

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        return b"data: " + self._head + b',"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n"


DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now_s() -> int:
    return int(time.time())


_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class HTTPError(Exception):
    """An error answered in vLLM's `ErrorResponse` shape. `err_type` defaults by status (vLLM's serving
    layer); request-schema errors carry "Bad Request" (its validation handler), LoRA admin errors
    "InvalidUserInput"."""

    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.err_type = err_type


def error_body(
    status: int, message: str, flat: bool = False, param: str | None = None, err_type: str | None = None
) -> dict[str, Any]:
    """vLLM's `{"error": {...}}`, or SGLang's flat non-streaming form."""
    err = {
        "message": message,
        "type": err_type or _TYPES.get(status, "InternalServerError"),
        "param": param,
        "code": status,
    }
    return {"object": "error", **err} if flat else {"error": err}
