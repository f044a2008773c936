"""Plausible, deterministic logprobs in vLLM's two layouts.

The sampled token is the most likely one (the simulator's output is what greedy decoding would give):
its probability p is drawn in [0.40, 0.97] from a hash of (output seed, position), and the alternatives
share the remaining 1 - p geometrically, so every value is <= 0, each list is sorted, and the
probabilities of a position sum to less than 1. Alternatives are other words of the output vocabulary.

Chat (vLLM's `_create_chat_logprobs`): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`
with `top_logprobs` entries, the sampled token first. Completions (`_create_completion_logprobs`):
`{"text_offset", "token_logprobs", "tokens", "top_logprobs": [{token: logprob}]}` with `logprobs + 1`
entries per position (the sampled token and `logprobs` alternatives), offsets counting characters.
"""

from __future__ import annotations

import math
from typing import Any

from gateway.sim.protocol import VOCAB

_NV = len(VOCAB)


def _draw(seed: int, pos: int) -> float:
    h = (seed * 1_000_003 + pos * 7_919 + 12_345) * 2_654_435_761 & 0xFFFFFFFF
    return h / 2**32


def position(seed: int, pos: int, token: str, k: int) -> list[tuple[str, float]]:
    """The sampled token and `k` alternatives at one position, as (token, logprob), most likely first."""
    u = _draw(seed, pos)
    p = 0.40 + 0.57 * u
    out = [(token, math.log(p))]
    rest = 1.0 - p
    anchor = (seed + pos) % _NV
    j = 0
    while len(out) <= k:
        alt = VOCAB[(anchor + 1 + 3 * j) % _NV]
        j += 1
        if alt == token:
            continue
        mass = rest * 0.5 ** len(out) * (0.9 + 0.1 * _draw(seed, pos * 31 + j))
        out.append((alt, math.log(mass)))
    return out


def chat_content(seed: int, start: int, tokens: list[str], top: int) -> list[dict[str, Any]]:
    """The `logprobs.content` entries of tokens at positions start, start+1, ..."""
    out = []
    for i, tok in enumerate(tokens):
        ranked = position(seed, start + i, tok, top)
        out.append(
            {
                "token": tok,
                "logprob": ranked[0][1],
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ranked[:top]
                ],
            }
        )
    return out


def completion(seed: int, start: int, tokens: list[str], k: int, text_offset: int) -> dict[str, Any]:
    """A completion choice's `logprobs` for tokens at positions start, ...; offsets start at `text_offset`."""
    offsets, values, tops = [], [], []
    for i, tok in enumerate(tokens):
        ranked = position(seed, start + i, tok, k)
        offsets.append(text_offset)
        text_offset += len(tok)
        values.append(ranked[0][1])
        tops.append(dict(ranked))
    return {"text_offset": offsets, "token_logprobs": values, "tokens": list(tokens), "top_logprobs": tops}
