"""Deterministic prompt text whose token count is exact and whose tokenization is stable.

Every word is a short lowercase word with a leading space that the shared tokenizer encodes
as one token. The tokenizer's pre-tokenizer splits before every such word, so BPE merges never
cross a word boundary: N words are N tokens, and concatenating blocks (or cutting them) never
changes how the neighbouring text tokenizes. Equal keys give byte-identical text, so prompts
built from the same blocks share exactly that many tokens of prefix.
"""

from __future__ import annotations

import itertools
import random
import re
import string
from functools import lru_cache

from gateway.prompt.tokens import get_tokenizer

_WORD = re.compile(r" [a-z]+")
_MAX_TOKEN_ID = 200_000


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Every ' word' (lowercase ascii) that the shared tokenizer keeps as one token, sorted.

    Candidates are all words of up to three letters plus whatever the tokenizer's own ids
    decode to, so a real BPE vocabulary contributes its longer words too (some 25k for
    cl100k), enough to give thousands of sibling blocks distinct first tokens.
    """
    tok = get_tokenizer()
    letters = string.ascii_lowercase
    candidates = {" " + "".join(p) for n in (1, 2, 3) for p in itertools.product(letters, repeat=n)}
    for token_id in range(_MAX_TOKEN_ID):
        try:
            piece = tok.decode([token_id])
        except Exception:  # ids outside the vocabulary: nothing to learn from them
            continue
        if _WORD.fullmatch(piece):
            candidates.add(piece)
    words = tuple(sorted(w for w in candidates if len(tok.encode(w)) == 1))
    if len(words) < 64:
        raise RuntimeError(f"tokenizer {tok.name} has only {len(words)} single-token words")
    return words


def words(key: str, n: int) -> str:
    """n tokens of text drawn from a generator seeded by `key`."""
    return "".join(random.Random(key).choices(vocabulary(), k=n))


def block(key: str, n_tokens: int, first: int) -> str:
    """n_tokens of text whose first token is word number `first` of the vocabulary (modulo its
    size) and the rest seeded by `key`: callers give sibling blocks distinct `first` values so
    that they differ from their very first token on."""
    if n_tokens <= 0:
        return ""
    vocab = vocabulary()
    return vocab[first % len(vocab)] + words(key, n_tokens - 1)


def numbered_words(key: str, n: int) -> str:
    """n words ` tN` (0 < N < 128000), as the GPU kit's prompts: one token each for its WordLevel
    tokenizer (and the simulator's `--tokenizer builtin:words`), about three each for cl100k."""
    rng = random.Random(key)
    return "".join(f" t{rng.randrange(1, 128000)}" for _ in range(n))
