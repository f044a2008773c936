"""Whether a relayed event stream had reached its end, so that a client closing right after it
counts as served (200), not as a client that gave up (499)."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.path.request_record import RequestRecord

log = logging.getLogger("gateway.path.proxy")

# Chat and completions streams end with `data: [DONE]`; it must be the last thing written.
_DONE = re.compile(rb"(?:^|\n)data: \[DONE\]\r?\n\r?\n\Z")
# The Responses API sends no [DONE]: its last event is a terminal `response.*` one, whose data can
# span many chunks, so it is looked for as chunks pass.
_RESPONSE_END = re.compile(rb"(?:^|\n)event: response\.(?:completed|incomplete|failed)\r?\n")
_TAIL = 64  # longer than any marker line, so a marker split between two chunks is still seen


class StreamEnd:
    """Fed the chunks written to the client, in order; `complete` once the last event was."""

    __slots__ = ("_last", "_last_event_seen", "_prev", "_responses")

    def __init__(self, endpoint: str) -> None:
        self._responses = endpoint == "responses"
        self._prev = self._last = b""
        self._last_event_seen = False

    def feed(self, chunk: bytes) -> None:
        # Runs for every chunk of every stream: for chat and completions it only keeps references.
        self._prev, self._last = self._last, chunk
        if self._responses and not self._last_event_seen and b"response." in chunk:
            self._last_event_seen = _RESPONSE_END.search(self._prev[-_TAIL:] + chunk) is not None

    @property
    def complete(self) -> bool:
        tail = self._prev[-_TAIL:] + self._last
        if self._responses:  # an event ends with a blank line
            return self._last_event_seen and tail.endswith((b"\n\n", b"\r\n\r\n"))
        return _DONE.search(tail) is not None


def client_left(end: StreamEnd, rec: RequestRecord) -> None:
    """The client closed its side while the stream was relayed: served if the last event had been
    written, a client that gave up otherwise."""
    rec.completed = end.complete
    if not rec.completed:
        rec.client_disconnected = True
        log.info("request %s: client went away mid-stream", rec.request_id)
