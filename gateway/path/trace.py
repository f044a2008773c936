"""Tracing as the request path sees it: a span per request, per stage and per upstream attempt.

`gateway.observe.tracing.Tracing` implements `Tracer` with OpenTelemetry. When tracing is off the
path gets `NO_TRACER`, whose spans do nothing, so it never asks whether tracing is on: a stage
costs one method call and a reused null context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from gateway.fleet.replica import Replica
from gateway.path.request_record import RequestRecord


class RequestSpan(Protocol):
    def end(self, rec: RequestRecord) -> None:
        """The request is over: `rec` says how it went."""


class AttemptSpan(Protocol):
    """One attempt at one replica."""

    @property
    def headers(self) -> Mapping[str, str]:
        """The headers to send the engine: the request's, carrying this span's context."""

    def responded(self, status: int) -> None:
        """The engine answered with `status`."""

    def end(self, rec: RequestRecord) -> None:
        """The attempt is over (called where an error in flight is still visible)."""


class Tracer(Protocol):
    def request(self, method: str, path: str, headers: Mapping[str, str], rec: RequestRecord) -> RequestSpan:
        """Start the request's span, parented on the client's trace context if it sent one."""

    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Any]:
        """A stage of the current request (canonicalize, tokenize, queue, route)."""

    def upstream(self, replica: Replica, attempt: int, headers: Mapping[str, str]) -> AttemptSpan:
        """Start an attempt's span; its `headers` propagate the context to the engine."""


_NULL: AbstractContextManager[None] = contextlib.nullcontext()


class _NoRequestSpan:
    __slots__ = ()

    def end(self, rec: RequestRecord) -> None:
        pass


class _NoAttemptSpan:
    __slots__ = ("headers",)

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = headers

    def responded(self, status: int) -> None:
        pass

    def end(self, rec: RequestRecord) -> None:
        pass


_NO_REQUEST_SPAN = _NoRequestSpan()


class NoTracer:
    """Tracing off: every span does nothing."""

    __slots__ = ()

    def request(
        self, method: str, path: str, headers: Mapping[str, str], rec: RequestRecord
    ) -> _NoRequestSpan:
        return _NO_REQUEST_SPAN

    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[None]:
        return _NULL

    def upstream(self, replica: Replica, attempt: int, headers: Mapping[str, str]) -> _NoAttemptSpan:
        return _NoAttemptSpan(headers)


NO_TRACER = NoTracer()
