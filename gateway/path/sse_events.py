"""A streamed answer relayed in whole events, so that it can be rewritten without parsing every chunk.

Chunks from an engine can end anywhere, inside a JSON member or between the two newlines that end an
event. Each chunk is relayed up to the end of its last complete event and the rest is held for the next
chunk: an SSE client acts on an event only once its blank line arrives, so holding the unfinished tail
delays nothing a client can use. On whole events two rewrites are safe and cheap:

- the response model's name (gateway/path/model_names.py), a byte replacement;
- an error event (`data: {"error": ...}`, as vLLM and SGLang send when a stream fails after it
  started) put in the gateway's one error form, found by a substring test and only then parsed.

An event larger than `max_event_bytes` is relayed as it stands (renamed, not normalized): nothing an
engine sends is held without bound.
"""

from __future__ import annotations

import orjson

from gateway.errors import error_body, normalize_error_body
from gateway.path.model_names import ModelRename

_ERROR = b'{"error"'
_DATA = b"data:"


def sse_error_event(message: str, code: str) -> bytes:
    """An error event in the gateway's one form, for a stream that broke after it began."""
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"


def _events_end(buf: bytes) -> int:
    """Where the last complete event of `buf` ends (after its blank line); 0 if none does."""
    lf = buf.rfind(b"\n\n")
    crlf = buf.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def normalize_error_events(events: bytes) -> bytes:
    """`events` (whole SSE events) with each `data:` error event in the OpenAI form."""
    out = []
    for event in events.split(b"\n\n"):
        stripped = event.lstrip(b"\r\n")
        if stripped.startswith(_DATA) and _ERROR in stripped[:32]:
            payload = stripped[len(_DATA) :].strip()
            try:
                doc = orjson.loads(payload)
            except orjson.JSONDecodeError:
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                code = doc["error"].get("code")
                status = code if isinstance(code, int) and 400 <= code <= 599 else 500
                lead = event[: len(event) - len(stripped)]
                event = lead + b"data: " + normalize_error_body(payload, status)
        out.append(event)
    return b"\n\n".join(out)


class EventStream:
    """Rewrites one streamed answer, chunk by chunk; `feed` every chunk, then `flush` once."""

    __slots__ = ("_held", "_limit", "_rename")

    def __init__(self, rename: ModelRename | None, max_event_bytes: int = 1 << 20) -> None:
        self._rename = rename or None
        self._held = b""
        self._limit = max_event_bytes

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream so far can be relayed now (possibly b"")."""
        buf = self._held + chunk if self._held else chunk
        end = _events_end(buf)
        if end < len(buf) and len(buf) - end <= self._limit:
            self._held = buf[end:]
            buf = buf[:end]
        else:
            self._held = b""
        return self._rewrite(buf) if buf else buf

    def flush(self) -> bytes:
        """The unfinished tail, at the end of the stream (an engine that broke off mid-event)."""
        held, self._held = self._held, b""
        return self._rewrite(held) if held else held

    def _rewrite(self, data: bytes) -> bytes:
        if self._rename is not None:
            data = self._rename.apply(data)
        if _ERROR in data:
            data = normalize_error_events(data)
        return data
