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

`prompt_pieces` gives the same text cut at message boundaries. A piece that comes back at the same
place in a chain (a system prompt, an earlier turn of a conversation) is cached whole from its
second sighting on, keyed by the chain state, the partial block carried into it and its 128-bit
digest: its block hashes and token counts then cost one lookup instead of a pass over its blocks,
and are the same as computed afresh.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from gateway.prompt.endpoints import BY_NAME, Endpoint
from gateway.prompt.tokens import get_tokenizer

# Where each endpoint that is no conversation carries its prompt(s) (the endpoint table).
_PROMPT_FIELDS: dict[str, tuple[str, ...]] = {
    e.name: e.prompt_fields for e in BY_NAME.values() if e.prompt_fields
}

_xxh64 = xxhash.xxh64_intdigest
# A JSON body's objects are dicts: checked first, isinstance skips the ABC's check (90 -> 15 ns).
_DICTS = (dict, Mapping)
_xxh128 = xxhash.xxh3_128_intdigest


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
            if isinstance(part, _DICTS) and part.get("type") == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif isinstance(part, str):
                pieces.append(part)
            else:
                # Images and audio are cached by the engine keyed on their content: a digest stands in
                # for them, so a large data URL costs one short placeholder instead of thousands of blocks.
                kind = part.get("type", "part") if isinstance(part, _DICTS) else "part"
                digest = _xxh64(_json(part).encode("utf-8", "surrogatepass"))
                pieces.append(f"<|{kind}:{digest:016x}|>")
        return "\n".join(pieces)
    if content is None:
        return ""
    return _json(content)


def message_text(message: Any) -> str:
    if not isinstance(message, _DICTS):
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


def _prompt_value(body: Mapping[str, Any], endpoint: str) -> Any:
    for name in _PROMPT_FIELDS[endpoint]:
        if name in body:
            return body[name]
    return None


def prompt_pieces(body: Mapping[str, Any], endpoint: Endpoint) -> list[str]:
    """The request's prompt as the engine caches it, in order, one piece per tool list or message.
    Of a batch of prompts, the first (each prompt is cached on its own: the first routes the batch)."""
    if not isinstance(body, _DICTS):
        return []
    if endpoint in _PROMPT_FIELDS:
        return [_first_prompt(_prompt_value(body, endpoint))]
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
        return out
    messages = body.get("messages")
    if isinstance(messages, list):
        out.extend(message_text(m) for m in messages)
    return out


def batch_tokens(
    body: Mapping[str, Any], endpoint: Endpoint, count: Callable[[str], int]
) -> tuple[int | None, int]:
    """What `prompt_pieces`' text does not count right in a prompt given as a list: (the first prompt's
    exact token count when it is token ids, else None; the tokens of the batch's other prompts)."""
    if endpoint not in _PROMPT_FIELDS or not isinstance(body, _DICTS):
        return None, 0
    value = _prompt_value(body, endpoint)
    if not isinstance(value, list) or not value:
        return None, 0
    if isinstance(value[0], int):  # one prompt of token ids
        return len(value), 0
    first = len(value[0]) if isinstance(value[0], list) else None
    rest = 0
    for prompt in value[1:]:
        if isinstance(prompt, str):
            rest += count(prompt)
        elif isinstance(prompt, list):
            rest += len(prompt)
    return first, rest


def prompt_text(body: Mapping[str, Any], endpoint: Endpoint) -> str:
    """`prompt_pieces` joined. Unknown shapes degrade to ''."""
    return "".join(prompt_pieces(body, endpoint))


@dataclass(slots=True)
class PrefixFeatures:
    block_hashes: list[int]  # chained hash of each full block, in order
    block_tokens: list[int]  # tokens of each full block (cut at word starts near its edges)
    prompt_tokens: int  # all blocks plus the partial tail


class _ReadThrough(OrderedDict[Any, Any]):
    """An LRU cache of its own in front of a shared one that it reads but never changes."""

    def __init__(self, shared: OrderedDict[Any, Any]) -> None:
        super().__init__()
        self.shared = shared

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key)
        return self.shared.get(key, default) if value is None else value

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or key in self.shared

    def move_to_end(self, key: Any, last: bool = True) -> None:
        if super().__contains__(key):
            super().move_to_end(key, last)


class PrefixHasher:
    """Chained block hashes and token counts of prompt text.

    Two bounded LRUs keep the work of repeated text: token counts of blocks, by block hash, and
    whole pieces of a prompt (a system prompt, an earlier turn), by their place in the chain, so a
    piece seen before costs one lookup instead of a loop over its blocks. Not thread-safe: meant
    for the gateway's event loop; `detached()` makes one for a worker thread.
    """

    def __init__(
        self,
        block_chars: int = 64,
        token_cache_size: int = 200_000,
        piece_cache_blocks: int = 65_536,
        piece_min_blocks: int = 8,
        count: Callable[[str], int] | None = None,
    ) -> None:
        if block_chars < 1:
            raise ValueError("block_chars must be positive")
        if token_cache_size < 1:
            raise ValueError("token_cache_size must be positive")
        if piece_cache_blocks < 1 or piece_min_blocks < 2:
            raise ValueError("piece_cache_blocks must be positive and piece_min_blocks at least 2")
        self.block_chars = block_chars
        self.token_cache_size = token_cache_size
        self.piece_cache_blocks = piece_cache_blocks
        self.piece_min_blocks = piece_min_blocks
        self._block_tokens: OrderedDict[int, int] = OrderedDict()
        # (chain state, partial block carried into the piece, 128-bit digest of the piece) -> the
        # hashes of the blocks that end in the piece, and the token counts of all of them but the
        # last. The digest is cheaper to take than str's hash (and to compare than the piece), and
        # keeps the cache from holding request text.
        self._pieces: OrderedDict[tuple[int, str, int], tuple[list[int], list[int]]] = OrderedDict()
        self._piece_blocks = 0
        self._seeds: dict[tuple[str, str | None], int] = {}
        self._count = count or get_tokenizer().count  # the engines' tokenizer when the pool knows it

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
        return self._hash_blocks(self.seed(model, cache_salt), text, 0, len(text) // self.block_chars)

    def _hash_blocks(self, h: int, text: str, first: int, last: int) -> list[int]:
        """Hashes of blocks first..last-1 of `text`, chained on from `h` (block first-1's hash)."""
        bc = self.block_chars
        chunk = text[first * bc : last * bc]
        hashes: list[int] = []
        if chunk.isascii():  # byte offsets are character offsets: encode once, slice the bytes
            data = chunk.encode()
            for start in range(0, len(data), bc):
                h = _xxh64(data[start : start + bc], h)
                hashes.append(h)
        else:
            for start in range(0, len(chunk), bc):
                h = _xxh64(chunk[start : start + bc].encode("utf-8", "surrogatepass"), h)
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

    def _count_blocks(self, text: str, hashes: list[int], tokens: list[int], upto: int) -> None:
        """Append the token counts of blocks len(tokens)..upto-1 (the hash of block upto is known).

        Block i's segment runs from its cut to block i+1's cut, so it is fixed by the chained hash
        of block i+1: that hash is its cache key."""
        cache = self._block_tokens
        cut_at, cut = -1, 0  # the last cut found, reused as the next block's start
        for i in range(len(tokens), upto):
            key = hashes[i + 1]
            count = cache.get(key)
            if count is None:
                start = cut if cut_at == i else self._cut(text, i)
                cut_at, cut = i + 1, self._cut(text, i + 1)
                count = cache[key] = self._count(text[start:cut])
            else:
                cache.move_to_end(key)
            tokens.append(count)

    def features(
        self, model: str, cache_salt: str | None, text: str, pieces: Sequence[str] = ()
    ) -> PrefixFeatures:
        """Block hashes and token counts of `text`.

        `pieces`, if given, are `text` cut where its content may repeat (as `prompt_pieces` cuts it,
        one per message): a piece in which `piece_min_blocks` or more blocks end is served from the
        piece cache once it has come back at the same place in a chain."""
        bc = self.block_chars
        n = len(text) // bc
        if not n:
            return PrefixFeatures(block_hashes=[], block_tokens=[], prompt_tokens=self._count(text))
        seed = self.seed(model, cache_salt)
        hashes: list[int] = []
        tokens: list[int] = []
        if pieces:
            if sum(map(len, pieces)) != len(text):
                raise ValueError("pieces must join to text")
            self._recall_pieces(seed, text, pieces, hashes, tokens)
        hashes += self._hash_blocks(hashes[-1] if hashes else seed, text, len(hashes), n)
        # The last full block's segment reaches into the tail: it is counted afresh, with the tail.
        self._count_blocks(text, hashes, tokens, n - 1)
        last = self._cut(text, n)
        tokens.append(self._count(text[self._cut(text, n - 1) : last]))
        tail = self._count(text[last:]) if last < len(text) else 0
        self._trim()
        return PrefixFeatures(block_hashes=hashes, block_tokens=tokens, prompt_tokens=sum(tokens) + tail)

    def _trim(self) -> None:
        """Evict the least recently used entries beyond the caches' bounds."""
        cache = self._block_tokens
        while len(cache) > self.token_cache_size:
            cache.popitem(last=False)
        memo = self._pieces
        while self._piece_blocks > self.piece_cache_blocks:
            self._piece_blocks -= len(memo.popitem(last=False)[1][0])

    def detached(self) -> PrefixHasher:
        """A hasher for work in another thread: it reads this one's caches without changing them
        (the event loop owns them) and keeps what it learns apart, for `absorb`."""
        clone = copy.copy(self)
        clone._block_tokens = _ReadThrough(self._block_tokens)
        clone._pieces = _ReadThrough(self._pieces)
        clone._piece_blocks = 0
        clone._seeds = {}
        return clone

    def absorb(self, detached: PrefixHasher, limit: int = 16_384) -> None:
        """Keep what a detached hasher learned, its first `limit` entries of each cache (a prompt's
        head is what comes back): called on the event loop, so bounded."""
        self._block_tokens.update(itertools.islice(detached._block_tokens.items(), limit))
        for key, value in itertools.islice(detached._pieces.items(), limit):
            if key not in self._pieces:
                self._pieces[key] = value
                self._piece_blocks += len(value[0])
        self._trim()

    def _recall_pieces(
        self, seed: int, text: str, pieces: Sequence[str], hashes: list[int], tokens: list[int]
    ) -> None:
        """Extend `hashes` (and `tokens`, one shorter) through the last long piece of `pieces`."""
        bc = self.block_chars
        memo = self._pieces
        start = 0
        for piece in pieces:
            end = start + len(piece)
            first, last = start // bc, end // bc
            if last - first >= self.piece_min_blocks:
                hashes += self._hash_blocks(hashes[-1] if hashes else seed, text, len(hashes), first)
                # The chain state stands for all text before block `first` (as the token cache's
                # keys do), the carried start of that block and the piece's digest for the rest.
                digest = _xxh128(piece.encode("utf-8", "surrogatepass"))
                key = (hashes[-1] if hashes else seed, text[first * bc : start], digest)
                known = memo.get(key)
                if known is None:
                    hashes += self._hash_blocks(key[0], text, first, last)
                    # Kept from its second sighting on (its first block was counted before): most
                    # pieces of new text, a user's question, never come back.
                    seen = hashes[first + 1] in self._block_tokens
                    self._count_blocks(text, hashes, tokens, last - 1)
                    if seen:
                        memo[key] = (hashes[first:], tokens[first:])
                        self._piece_blocks += last - first
                else:
                    memo.move_to_end(key)
                    hashes += known[0]
                    self._count_blocks(text, hashes, tokens, first)
                    tokens += known[1]
            start = end

    def cached_blocks(self) -> int:
        return len(self._block_tokens)

    def cached_pieces(self) -> int:
        return len(self._pieces)
