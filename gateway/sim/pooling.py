"""Pooling-model outputs: deterministic embeddings and the scores built from them.

An input's vector is a hashed bag of its tokens (each token adds +-1 at four positions picked by a hash of
its id) and of the character trigrams of its words (each adds +-1/2 at two positions picked by a stable
hash), normalized to unit length: equal texts give equal vectors, texts that share tokens score high under
cosine similarity, and texts that share only parts of words (`capital` and `capitals`, `France` and
`France's`) still score above unrelated ones, as real embeddings roughly do; the same input gives the same
vector in every process. `dimensions` truncates and renormalizes (a Matryoshka model). Score and rerank
use the cosine similarity of the two embeddings, which is what vLLM does for an embedding (bi-encoder)
model.

Response layouts follow vLLM's pooling protocols (vllm/entrypoints/pooling/{embed,pooling,score}/protocol.py):
`/v1/embeddings` {id "embd-...", object "list", created, model, data [{index, object "embedding",
embedding}], usage}; `/pooling` the same with object "pooling" and `data`; `/score` data [{index, object
"score", score}]; `/rerank` {id, model, usage {prompt_tokens, total_tokens}, results [{index, document
{text}, relevance_score}]} sorted by score, cut to `top_n` when it is set.
"""

from __future__ import annotations

import base64
import math
import re
from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

_MASK = 2**64 - 1
_WORD = re.compile(r"\w+")


def embed(ids: Sequence[int], text: str, dim: int, normalize: bool = True) -> list[float]:
    """The vector of an input: its token ids and its text (the ids decoded, or as sent)."""
    v = [0.0] * dim
    for t in ids:
        _spread(v, (t + 1) * 0x9E3779B97F4A7C15, 4, 1.0)
    for word in _WORD.findall(text.lower()):
        padded = f"<{word}>"
        for k in range(len(padded) - 2):
            _spread(v, xxhash.xxh64_intdigest(padded[k : k + 3].encode()), 2, 0.5)
    if not any(v):
        v[0] = 1.0  # an empty input still gets a unit vector
    if normalize:
        norm = math.sqrt(sum(x * x for x in v))
        v = [x / norm for x in v]
    return v


def _spread(v: list[float], seed: int, positions: int, weight: float) -> None:
    """Add +-`weight` at `positions` places of `v` picked by the bits of `seed` (a hash)."""
    h = seed & _MASK
    h ^= h >> 29
    dim = len(v)
    for j in range(positions):
        bits = (h >> (16 * j)) & 0xFFFF
        v[(bits >> 1) % dim] += weight if bits & 1 else -weight


def truncate(v: list[float], dimensions: int | None) -> list[float]:
    if dimensions is None or dimensions >= len(v):
        return v
    head = v[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def encode(v: list[float], encoding_format: str) -> list[float] | str:
    """`float`: the list; `base64`: little-endian float32 bytes, as the openai SDK decodes them."""
    if encoding_format == "base64":
        return base64.b64encode(array("f", v).tobytes()).decode()
    return v


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=False))
    na = math.sqrt(sum(x * x for x in a)) or 1.0
    nb = math.sqrt(sum(y * y for y in b)) or 1.0
    return dot / (na * nb)


def pair_up(n1: int, n2: int) -> list[tuple[int, int]]:
    """vLLM's score pairing: one against many, or element by element for equal lengths."""
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 == n2:
        return [(i, i) for i in range(n1)]
    raise ValueError("Input lengths must be either 1:1, 1:N or N:N")


def usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
