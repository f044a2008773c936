"""OpenTelemetry spans for a request's path (queue, canonicalize, route, upstream) and W3C propagation.

Off by default: then the request path gets `gateway.path.trace.NO_TRACER`, whose spans do
nothing. On (`telemetry.tracing: true`), `Tracing` is its tracer: each request gets a
server span, parented on the client's `traceparent` if it sent one; stages are its children;
each upstream attempt is a client span whose context replaces `traceparent`/`tracestate` in
the headers sent to the engine. Export follows the standard variables: `OTEL_TRACES_EXPORTER`
(otlp | console | none; default otlp over HTTP/protobuf), `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_PROPAGATORS`, `OTEL_SDK_DISABLED`.
A local view without a collector: `OTEL_TRACES_EXPORTER=console` prints each span to stdout. An
exporter that fails (no collector listening) is one warning while it fails, and one line when it
works again, not the OTLP exporter's error per batch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from gateway.config import TelemetryConfig
from gateway.fleet.replica import Replica
from gateway.path.request_record import RequestRecord

log = logging.getLogger(__name__)

_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})


def _exporters() -> list[SpanExporter]:
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    out: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
            )
            if protocol == "grpc":
                log.warning("OTLP over gRPC is not installed; exporting traces over HTTP/protobuf")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # It logs an error per failed batch (and a warning per retry); _Reported says it once.
            logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.CRITICAL)
            otlp = OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_* itself
            out.append(_Reported(otlp, f"OTLP to {getattr(otlp, '_endpoint', 'the collector')}"))
        elif name == "console":
            out.append(ConsoleSpanExporter())
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); ignored", name)
    return out


class _Reported(SpanExporter):
    """An exporter whose failures are logged once while they last, and its recovery once."""

    def __init__(self, inner: SpanExporter, what: str) -> None:
        self.inner = inner
        self.what = what
        self.failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # the batch processor would log it with a traceback, per batch
            log.debug("trace export (%s) raised: %s", self.what, exc)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.FAILURE and not self.failing:
            self.failing = True
            log.warning(
                "traces are not exported (%s fails; spans are dropped until it answers): start a "
                "collector, or set OTEL_TRACES_EXPORTER=console to print spans, none to drop them",
                self.what,
            )
        elif result is SpanExportResult.SUCCESS and self.failing:
            self.failing = False
            log.info("trace export (%s) works again", self.what)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Tracing:
    """A tracer provider owned by one runtime (not the process-global one, so several gateways
    in one process, as in tests, keep their spans apart)."""

    def __init__(self, service_name: str, exporters: list[SpanExporter] | None = None) -> None:
        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
        self.provider = TracerProvider(resource=Resource.create(attrs))
        for exporter in _exporters() if exporters is None else exporters:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvgate")

    @classmethod
    def from_config(cls, cfg: TelemetryConfig) -> Tracing | None:
        if not cfg.tracing or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return None
        return cls(cfg.service_name)

    async def shutdown(self) -> None:
        # Flushing may wait on the exporter's network timeout: keep it off the event loop.
        await asyncio.to_thread(self.provider.shutdown)

    # -- per request ------------------------------------------------------------------------
    def request(self, method: str, path: str, headers: Mapping[str, str], rec: RequestRecord) -> RequestSpan:
        """Start the request's server span and make it current for the stages that follow."""
        parent = propagate.extract(headers)
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,
                "kvgate.request_id": rec.request_id,
                "kvgate.endpoint": rec.endpoint,
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return RequestSpan(span, token)

    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Span]:
        """A stage of the current request (queue, canonicalize, route); errors mark it failed."""
        return self.tracer.start_as_current_span(name, attributes=attributes)

    def upstream(self, replica: Replica, attempt: int, headers: Mapping[str, str]) -> UpstreamSpan:
        span = self.tracer.start_span(
            "upstream",
            kind=SpanKind.CLIENT,
            attributes={
                "kvgate.replica": replica.name,
                "kvgate.pool": replica.pool,
                "kvgate.attempt": attempt,
                "server.address": replica.url,
            },
        )
        carrier = {k: v for k, v in headers.items() if k.lower() not in _TRACE_HEADERS}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return UpstreamSpan(span, replica.name, carrier)


def _outcome(span: Span, rec: RequestRecord) -> None:
    if rec.status:
        span.set_attribute("http.response.status_code", rec.status)
    if rec.error_code:
        span.set_attribute("error.type", rec.error_code)
    if rec.status >= 500 or rec.error_code == "upstream_stream_error":
        span.set_status(Status(StatusCode.ERROR, rec.error_code or str(rec.status)))


class RequestSpan:
    __slots__ = ("span", "token")

    def __init__(self, span: Span, token: object) -> None:
        self.span = span
        self.token = token

    def end(self, rec: RequestRecord) -> None:
        span = self.span
        for key, value in (
            ("kvgate.model", rec.model),
            ("kvgate.pool", rec.pool),
            ("kvgate.replica", rec.replica),
            ("kvgate.priority_class", rec.priority_class),
            ("kvgate.route_reason", rec.route_reason),
            ("kvgate.shed_reason", rec.shed_reason),
        ):
            if value is not None:
                span.set_attribute(key, value)
        span.set_attribute("kvgate.stream", rec.stream)
        span.set_attribute("kvgate.prompt_tokens", rec.prompt_tokens)
        span.set_attribute("kvgate.cached_tokens", rec.matched_tokens)
        span.set_attribute("kvgate.retries", rec.retries)
        span.set_attribute("kvgate.queue_s", rec.queued_s)
        if rec.ttft_s is not None:
            span.set_attribute("kvgate.ttft_s", rec.ttft_s)
        if rec.client_disconnected:
            span.set_attribute("kvgate.client_disconnected", True)
        _outcome(span, rec)
        span.end()
        otel_context.detach(self.token)  # type: ignore[arg-type]


class UpstreamSpan:
    """One attempt at one replica; `headers` carry this span's context to the engine."""

    __slots__ = ("headers", "replica", "span", "status")

    def __init__(self, span: Span, replica: str, headers: dict[str, str]) -> None:
        self.span = span
        self.replica = replica
        self.headers = headers
        self.status = 0

    def responded(self, status: int) -> None:
        self.status = status
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500 or status == 429:
            self.span.set_status(Status(StatusCode.ERROR, str(status)))

    def end(self, rec: RequestRecord) -> None:
        """Close the attempt; called from the proxy's `finally`, so an error in flight is visible."""
        span = self.span
        exc = sys.exc_info()[1]
        if isinstance(exc, asyncio.CancelledError):
            span.set_attribute("kvgate.client_disconnected", True)
        elif exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        if rec.replica == self.replica and self.status:  # the attempt that answered the client
            span.set_attribute("kvgate.cached_tokens", rec.matched_tokens)
            if rec.route_reason:
                span.set_attribute("kvgate.route_reason", rec.route_reason)
            if rec.ttft_s is not None:
                span.set_attribute("kvgate.ttft_s", rec.ttft_s)
            if rec.error_code:
                span.set_attribute("error.type", rec.error_code)
                span.set_status(Status(StatusCode.ERROR, rec.error_code))
        span.end()
