"""Responses name the model the client asked for: the engine's name for it is replaced in the bytes.

An engine writes the response's model as one JSON member, `"model":"<name>"`: vLLM and SGLang
serialize compactly (pydantic's `model_dump_json`, Starlette's and orjson's responses); Python's
`json.dumps` defaults, which some servers use, put a space after the colon and escape non-ASCII
characters. Each form is replaced by the same form naming the client's model. No parsing is needed
and none of generated text is touched: inside a JSON string every quote is escaped, so a completion
that writes `"model":"llama"` reaches the wire as `\\"model\\":\\"llama\\"`, and the exact bytes with
bare quotes can only be the member itself. The closing quote is part of what is matched, so a longer
name that starts with the upstream one (`llama-2` for `llama`) is left alone.

Streams are cut into whole events before this runs (gateway/path/sse_events.py), so a member is never
split across two pieces.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import orjson


def _encodings(name: str) -> list[bytes]:
    """The JSON strings an engine may write for `name`: raw UTF-8, and ASCII with \\u escapes."""
    compact = orjson.dumps(name)
    ascii_form = json.dumps(name).encode()
    return [compact] if ascii_form == compact else [compact, ascii_form]


class ModelRename:
    """Replaces the response `model` member naming any of `upstream` by one naming `client`."""

    __slots__ = ("_pairs", "client", "upstream")

    def __init__(self, upstream: Iterable[str], client: str) -> None:
        self.upstream = tuple(dict.fromkeys(u for u in upstream if u != client))
        self.client = client
        client_forms = _encodings(client)
        pairs: dict[bytes, bytes] = {}
        for name in self.upstream:
            for i, form in enumerate(_encodings(name)):
                # The client's name in the same encoding as the form it replaces.
                replacement = client_forms[min(i, len(client_forms) - 1)]
                for sep in (b":", b": "):
                    pairs[b'"model"' + sep + form] = b'"model"' + sep + replacement
        self._pairs = tuple(pairs.items())

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def apply(self, data: bytes) -> bytes:
        """`data` (a whole body, or whole SSE events) with every such member renamed."""
        for needle, replacement in self._pairs:
            data = data.replace(needle, replacement)
        return data


class Renames:
    """The renames in use, made once per (engine names, client name): a request reuses its pair's."""

    def __init__(self, kept: int = 1024) -> None:
        self._kept = kept  # bounds the cache: client names are the clients' to choose
        self._renames: dict[tuple[tuple[str, ...], str], ModelRename] = {}

    def get(self, engine_names: tuple[str, ...], client: str) -> ModelRename | None:
        """What puts `client` in place of `engine_names` in an answer; None when there is nothing to do."""
        if not engine_names:
            return None
        key = (engine_names, client)
        rename = self._renames.get(key)
        if rename is None:
            if len(self._renames) >= self._kept:
                self._renames.clear()
            rename = self._renames[key] = ModelRename(engine_names, client)
        return rename
