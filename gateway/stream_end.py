"""Whether a relayed event stream has reached its end, so that a client closing right after it
counts as served (200), not as a client that gave up (499)."""

from __future__ import annotations

import re

# The last event of a stream: `data: [DONE]` (chat and completions), or a terminal `response.*`
# event (the Responses API, which sends no [DONE]).
_LAST_EVENT = re.compile(rb"(?:^|\n)(?:data: \[DONE\]|event: response\.(?:completed|incomplete|failed))\r?\n")
_TAIL = 64  # longer than any marker line, so a marker split between two chunks is still seen


class StreamEnd:
    """Fed the chunks written to the client, in order; true once the last event is complete."""

    __slots__ = ("_last_seen", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._last_seen = False

    def feed(self, chunk: bytes) -> bool:
        window = self._tail + chunk
        self._tail = window[-_TAIL:]
        if not self._last_seen and _LAST_EVENT.search(window):
            self._last_seen = True
        # An event ends with a blank line; the last event's data line may come in later chunks.
        return self._last_seen and window.endswith((b"\n\n", b"\r\n\r\n"))
