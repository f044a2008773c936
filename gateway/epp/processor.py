"""One ext_proc stream per HTTP request: the Endpoint Picker's side of Envoy's
`ExternalProcessor/Process`, request and response bodies in FULL_DUPLEX_STREAMED mode.

The request's headers are held unanswered while its body arrives (bounded: `server.max_body_bytes`
and `epp.max_request_messages`); once it is whole the picker decides, and the headers' answer (the
destination) goes back, then the body (rewritten where the preparation step changed it), in
headers-body-trailers order as the mode requires. A refusal is Envoy's ImmediateResponse in the
OpenAI error form. The answer then streams through: its headers name the replica that served, its
body is relayed event by event (a streamed answer) or whole (a JSON one, bounded), with the model's
name as the client asked for it, and its first bytes, usage and end reach the picker.

Whatever ends the stream (the answer's end, a refusal, Envoy closing it because the client left or
the upstream reset, a cancelled RPC at shutdown), the pick is settled exactly once (`Pick.ended`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from gateway.config import EppConfig, ServerConfig
from gateway.epp import protocol
from gateway.epp.picking import Pick, Picker, Refusal, refusal
from gateway.path.request_record import USAGE_MARK
from gateway.path.sse_events import EventStream

log = logging.getLogger(__name__)


class Processor:
    """The ext_proc service: each `Process` stream is one request and its answer."""

    def __init__(self, picker: Picker, server: ServerConfig, cfg: EppConfig) -> None:
        self.picker = picker
        self.max_body_bytes = server.max_body_bytes
        self.max_messages = cfg.max_request_messages
        self.max_buffer = cfg.max_response_buffer_bytes

    async def Process(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        stream = _Stream(self)
        try:
            async for message in request_iterator:
                for answer in await stream.on(message):
                    yield answer
                if stream.closed:
                    return
        finally:
            stream.settle()


class _Stream:
    """The state of one request's stream: its request until routed, then its answer."""

    __slots__ = (
        "body",
        "buffer",
        "closed",
        "events",
        "headers",
        "messages",
        "owner",
        "passthrough",
        "pick",
        "status",
        "subset",
        "usage",
    )

    def __init__(self, owner: Processor) -> None:
        self.owner = owner
        self.headers: dict[str, str] | None = None
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.messages = 0
        self.pick: Pick | None = None
        self.closed = False
        # The answer: its status, its events (a stream) or its bytes held whole (JSON).
        self.status = 0
        self.events: EventStream | None = None
        self.buffer: bytearray | None = None
        self.passthrough = False
        self.usage: bytes | None = None

    async def on(self, msg: Any) -> list[Any]:
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(msg)
        if kind == "request_body":
            return await self._request_body(msg.request_body)
        if kind == "request_trailers":
            return [*await self._route(trailers=True), protocol.trailers(request=True)]
        if kind == "response_headers":
            return self._response_headers(msg)
        if kind == "response_body":
            return self._response_body(msg.response_body.body, msg.response_body.end_of_stream)
        if kind == "response_trailers":
            return [*self._response_body(b"", True, trailers=True), protocol.trailers(request=False)]
        return []

    # -- the request ----------------------------------------------------------------------------
    async def _request_headers(self, msg: Any) -> list[Any]:
        if self.headers is not None:
            return self._refuse(refusal(400, "request headers arrived twice", "invalid_stream"))
        self.messages += 1
        self.headers = protocol.headers_of(msg.request_headers)
        self.subset = protocol.subset_hint(msg)
        if msg.request_headers.end_of_stream:
            return await self._route(bodiless=True)
        return []

    async def _request_body(self, part: Any) -> list[Any]:
        if self.headers is None or self.pick is not None:
            return self._refuse(refusal(400, "request body out of order", "invalid_stream"))
        self.messages += 1
        self.body += part.body
        if len(self.body) > self.owner.max_body_bytes:
            limit = self.owner.max_body_bytes
            return self._refuse(refusal(413, f"request body exceeds {limit} bytes", "request_too_large"))
        if self.messages > self.owner.max_messages:
            return self._refuse(
                refusal(413, "request body arrived in too many pieces", "request_too_fragmented")
            )
        if part.end_of_stream:
            return await self._route()
        return []

    async def _route(self, bodiless: bool = False, trailers: bool = False) -> list[Any]:
        """Decide, once the request is whole: the destination, then the body."""
        if self.headers is None:
            return self._refuse(refusal(400, "request trailers before its headers", "invalid_stream"))
        if self.pick is not None:
            return []
        decided = await self.owner.picker.pick(self.headers, bytes(self.body), self.subset)
        if isinstance(decided, Refusal):
            return self._refuse(decided)
        self.pick = decided
        out = [protocol.route(decided.endpoints, decided.set_headers, decided.remove_headers)]
        if not bodiless:
            body = decided.body if decided.body is not None else bytes(self.body)
            out += protocol.body_chunks(body, end=not trailers, request=True)
        self.body = bytearray()
        return out

    def _refuse(self, no: Refusal) -> list[Any]:
        self.closed = True
        return [protocol.immediate(no.status, no.body, no.headers)]

    # -- the answer -----------------------------------------------------------------------------
    def _response_headers(self, msg: Any) -> list[Any]:
        headers = protocol.headers_of(msg.response_headers)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        pick = self.pick
        if pick is None or pick.req is None:
            self.passthrough = True
            return [protocol.answer_headers({})]
        added = pick.served(protocol.served_endpoint(msg), self.status)
        if "text/event-stream" in headers.get("content-type", ""):
            self.events = EventStream(pick.rename)
        elif not headers.get("content-encoding"):
            self.buffer = bytearray()
        else:
            self.passthrough = True  # a compressed answer is relayed as it is
        out = [protocol.answer_headers(added)]
        if msg.response_headers.end_of_stream:
            self._end(None)
        return out

    def _response_body(self, data: bytes, end: bool, trailers: bool = False) -> list[Any]:
        """Relay a piece of the answer; `end` (its last, or its trailers follow) ends the request."""
        pick = self.pick
        out = data
        if self.events is not None:
            out = self.events.feed(data)
            if end:
                out += self.events.flush()
            if USAGE_MARK in out:
                self.usage = out
        elif self.buffer is not None:
            self.buffer += data
            if len(self.buffer) > self.owner.max_buffer:
                out, self.buffer, self.passthrough = bytes(self.buffer), None, True
            elif not end:
                out = b""
            else:
                out = bytes(self.buffer)
                if pick is not None and pick.rename is not None:
                    out = pick.rename.apply(out)
                self.usage = out
        if out and pick is not None and self.status == 200:
            pick.first_token()
        answers = list(protocol.body_chunks(out, end=end and not trailers, request=False))
        if end:
            self._end(None)
        return answers

    def _end(self, error: str | None) -> None:
        if self.pick is not None:
            self.pick.ended(self.status, self.usage, error)

    def settle(self) -> None:
        """The stream is over: a request that did not end with its answer is settled as cut."""
        self.closed = True
        if self.pick is not None:
            self.pick.ended(self.status, self.usage, "client_disconnected")
