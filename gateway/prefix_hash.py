"""Prompt prefix features for routing: the text an engine will cache, cut into chained block hashes.

`prompt_text` serializes a request in the order the engine sees it (tool definitions, then each
message with its role marker), so two requests share a hashed block only where the engine could
share KV blocks. `PrefixHasher` cuts that text into fixed-size character blocks and chains them:
h_i = xxh64(block_i, seed=h_{i-1}), with h_{-1} derived from the model and `cache_salt`. Equal
hashes at position i therefore mean equal text up to the end of block i, and a different salt
gives a disjoint chain, as in vLLM where the salt enters the first block's hash.

Per-block token counts are cached by block hash, so a prompt whose prefix was seen before only
tokenizes its new blocks, its last full block and its partial tail. Blocks are counted between
word starts near the block edges, which keeps the sum within about 0.2% of a whole-text count on
prose, code and JSON (a raw-edge cut overcounts by 5-10%).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash

from gateway.tokens import get_tokenizer

Endpoint = Literal["chat", "completions", "responses"]

_xxh64 = xxhash.xxh64_intdigest


def chain_seed(model: str, cache_salt: str | None) -> int:
    """The seed of a block chain: distinct per model, and per salt when one is given."""
    key = model if cache_salt is None else f"{model}\x00{cache_salt}"
    return _xxh64(key.encode("utf-8", "surrogatepass"))


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # e.g. integers beyond 64 bits, which orjson refuses
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif isinstance(part, str):
                pieces.append(part)
            else:
                # Images and audio are cached by the engine keyed on their content: a digest stands in
                # for them, so a large data URL costs one short placeholder instead of thousands of blocks.
                kind = part.get("type", "part") if isinstance(part, Mapping) else "part"
                digest = _xxh64(_json(part).encode("utf-8", "surrogatepass"))
                pieces.append(f"<|{kind}:{digest:016x}|>")
        return "\n".join(pieces)
    if content is None:
        return ""
    return _json(content)


def message_text(message: Any) -> str:
    if not isinstance(message, Mapping):
        return f"<|?|>{_json(message)}\n"
    role = message.get("role", "?")
    name = message.get("name")
    head = f"<|{role}:{name}|>" if isinstance(name, str) else f"<|{role}|>"
    text = head + _content_text(message.get("content"))
    for key in ("tool_calls", "function_call"):
        if message.get(key):
            text += f"<|{key}|>{_json(message[key])}"
    if isinstance(message.get("tool_call_id"), str):
        text += f"<|tool_call_id:{message['tool_call_id']}|>"
    return text + "\n"


def _first_prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):  # one prompt given as token ids
            return " ".join(str(t) for t in prompt)
        if isinstance(first, list):  # a batch of token-id prompts
            return " ".join(str(t) for t in first)
    return ""


def prompt_text(body: Mapping[str, Any], endpoint: Endpoint) -> str:
    """The request's prompt as the engine caches it, in order. Unknown shapes degrade to ''."""
    if not isinstance(body, Mapping):
        return ""
    if endpoint == "completions":
        return _first_prompt(body.get("prompt"))
    out: list[str] = []
    tools = body.get("tools")
    if tools:
        out.append(f"<|tools|>{_json(tools)}\n")
    if endpoint == "responses":
        if isinstance(body.get("instructions"), str):
            out.append(f"<|system|>{body['instructions']}\n")
        items = body.get("input")
        if isinstance(items, str):
            out.append(f"<|user|>{items}\n")
        elif isinstance(items, list):
            out.extend(message_text(m) for m in items)
        return "".join(out)
    messages = body.get("messages")
    if isinstance(messages, list):
        out.extend(message_text(m) for m in messages)
    return "".join(out)


@dataclass(slots=True)
class PrefixFeatures:
    block_hashes: list[int]  # chained hash of each full block, in order
    block_tokens: list[int]  # tokens of each full block (cut at word starts near its edges)
    prompt_tokens: int  # all blocks plus the partial tail


class PrefixHasher:
    """Chained block hashes and token counts of prompt text; keeps a bounded LRU of block token counts.

    Not thread-safe: meant for the gateway's event loop.
    """

    def __init__(self, block_chars: int = 64, token_cache_size: int = 200_000) -> None:
        if block_chars < 1:
            raise ValueError("block_chars must be positive")
        if token_cache_size < 1:
            raise ValueError("token_cache_size must be positive")
        self.block_chars = block_chars
        self.token_cache_size = token_cache_size
        self._block_tokens: OrderedDict[int, int] = OrderedDict()
        self._seeds: dict[tuple[str, str | None], int] = {}
        self._count = get_tokenizer().count

    def seed(self, model: str, cache_salt: str | None) -> int:
        key = (model, cache_salt)
        seed = self._seeds.get(key)
        if seed is None:
            if len(self._seeds) >= 4096:  # salts can be per user: bound the memo
                self._seeds.clear()
            seed = self._seeds[key] = chain_seed(model, cache_salt)
        return seed

    def block_hashes(self, model: str, cache_salt: str | None, text: str) -> list[int]:
        """Only the chained hashes (no token counts)."""
        return self._hash_blocks(self.seed(model, cache_salt), text)

    def _hash_blocks(self, seed: int, text: str) -> list[int]:
        bc = self.block_chars
        full = len(text) // bc
        data = text.encode("utf-8", "surrogatepass")
        hashes: list[int] = []
        h = seed
        if len(data) == len(text):  # ASCII: byte offsets are character offsets, slice the bytes
            for start in range(0, full * bc, bc):
                h = _xxh64(data[start : start + bc], h)
                hashes.append(h)
        else:
            for start in range(0, full * bc, bc):
                h = _xxh64(text[start : start + bc].encode("utf-8", "surrogatepass"), h)
                hashes.append(h)
        return hashes

    def _cut(self, text: str, i: int) -> int:
        """Where block i's token segment starts: its first space that follows a non-space, if any.
        cl100k (like most BPE pretokenizers) starts words with their leading space, so cutting
        there, not at the raw block edge, keeps block-wise counts within a token or two of a
        whole-text count instead of about one token too many per block."""
        start = i * self.block_chars
        if i == 0:
            return 0
        end = min(start + self.block_chars, len(text))
        j = text.find(" ", start, end)
        while j > 0 and text[j - 1].isspace():
            j = text.find(" ", j + 1, end)
        return start if j == -1 else j

    def features(self, model: str, cache_salt: str | None, text: str) -> PrefixFeatures:
        hashes = self._hash_blocks(self.seed(model, cache_salt), text)
        n = len(hashes)
        if not n:
            return PrefixFeatures(block_hashes=hashes, block_tokens=[], prompt_tokens=self._count(text))
        cache = self._block_tokens
        tokens: list[int] = []
        # Block i's segment runs from its cut to block i+1's cut, so it is fixed by the chained
        # hash of block i+1: that hash is its cache key. The last full block's segment reaches into
        # the tail and is counted afresh, with the tail.
        for i in range(n - 1):
            key = hashes[i + 1]
            count = cache.get(key)
            if count is None:
                count = cache[key] = self._count(text[self._cut(text, i) : self._cut(text, i + 1)])
                if len(cache) > self.token_cache_size:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(key)
            tokens.append(count)
        last = self._cut(text, n)
        tokens.append(self._count(text[self._cut(text, n - 1) : last]))
        tail = self._count(text[last:]) if last < len(text) else 0
        return PrefixFeatures(block_hashes=hashes, block_tokens=tokens, prompt_tokens=sum(tokens) + tail)

    def cached_blocks(self) -> int:
        return len(self._block_tokens)
