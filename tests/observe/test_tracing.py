"""OpenTelemetry: spans of a real gateway's requests, their links, and W3C context sent upstream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.config import Settings, TelemetryConfig
from gateway.observe.tracing import Tracing, _exporters
from gateway.server import RunningGateway, start_gateway
from tests.conftest import free_port, gateway_settings
from tests.upstream_app import Upstream

MakeUpstreams = Callable[[int], Awaitable[list[Upstream]]]
MakeGateway = Callable[[Settings], Awaitable[RunningGateway]]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def chat(text: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": f"Today is 2026-11-29. {text}"}]}


@pytest.fixture
async def traced(
    upstreams: MakeUpstreams, gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[RunningGateway, list[Upstream], InMemorySpanExporter]]:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")  # only the in-memory exporter below
    ups = await upstreams(2)
    settings = gateway_settings(
        [u.url for u in ups], telemetry={"tracing": True}, pool={"canonicalize": {"enabled": True}}
    )
    gw = await gateway(settings)
    assert gw.runtime.tracing is not None
    exporter = InMemorySpanExporter()
    gw.runtime.tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield gw, ups, exporter


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_request_spans_link_and_propagate(
    traced: tuple[RunningGateway, list[Upstream], InMemorySpanExporter],
) -> None:
    gw, ups, exporter = traced
    async with httpx.AsyncClient(base_url=gw.url) as client:
        resp = await client.post(
            "/v1/chat/completions", json=chat("hello"), headers={"traceparent": CLIENT_TRACEPARENT}
        )
    assert resp.status_code == 200
    spans = exporter.get_finished_spans()
    (root,) = by_name(spans, "POST /v1/chat/completions")
    assert root.kind is SpanKind.SERVER
    assert root.context is not None and root.parent is not None
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE  # joined the client's trace
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 200
    assert root.attributes["kvgate.pool"] == "p" and root.attributes["kvgate.prompt_tokens"] > 0
    for name in ("canonicalize", "queue", "route", "upstream"):
        (child,) = by_name(spans, name)
        assert child.parent is not None and child.parent.span_id == root.context.span_id, name
        assert child.context is not None and child.context.trace_id == root.context.trace_id
    (up,) = by_name(spans, "upstream")
    assert up.kind is SpanKind.CLIENT and up.attributes is not None
    assert up.attributes["kvgate.replica"] == resp.headers["x-kvgate-replica"]
    assert up.attributes["http.response.status_code"] == 200
    assert up.attributes["kvgate.ttft_s"] > 0 and "kvgate.cached_tokens" in up.attributes

    (seen,) = [s for u in ups for s in u.state.seen]
    assert len(seen.headers.getall("traceparent")) == 1  # the client's was replaced, not duplicated
    _version, trace_id, parent_id, _flags = seen.headers["traceparent"].split("-")
    assert up.context is not None
    assert (trace_id, parent_id) == (CLIENT_TRACE, format(up.context.span_id, "016x"))


async def test_each_attempt_is_a_span(
    traced: tuple[RunningGateway, list[Upstream], InMemorySpanExporter],
) -> None:
    gw, ups, exporter = traced
    ups[0].state.force_status = 503
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for i in range(2):  # round robin: one of the two starts on the failing replica
            assert (await client.post("/v1/chat/completions", json=chat(f"q{i}"))).status_code == 200
    spans = exporter.get_finished_spans()
    failed = [s for s in by_name(spans, "upstream") if s.status.status_code is StatusCode.ERROR]
    assert failed and all(s.attributes and s.attributes["http.response.status_code"] == 503 for s in failed)
    retried = [
        s
        for s in by_name(spans, "POST /v1/chat/completions")
        if s.attributes and s.attributes["kvgate.retries"]
    ]
    assert retried
    root = retried[0]
    assert root.context is not None
    attempts = [
        s for s in by_name(spans, "upstream") if s.parent and s.parent.span_id == root.context.span_id
    ]
    assert [s.attributes["kvgate.attempt"] for s in attempts if s.attributes] == [0, 1]
    # the upstream saw two different parent span ids for the two attempts of one trace
    seen = [s.headers["traceparent"] for u in ups for s in u.state.seen]
    assert len(set(seen)) == len(seen) == 3


async def test_errors_mark_the_request_span(
    traced: tuple[RunningGateway, list[Upstream], InMemorySpanExporter],
) -> None:
    gw, ups, exporter = traced
    for u in ups:
        u.state.force_status = 500
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.post("/v1/chat/completions", json=chat("boom"))).status_code == 500
    (root,) = by_name(exporter.get_finished_spans(), "POST /v1/chat/completions")
    assert root.status.status_code is StatusCode.ERROR


async def test_off_by_default_passes_client_context_through(
    upstreams: MakeUpstreams, gateway: MakeGateway
) -> None:
    ups = await upstreams(1)
    gw = await gateway(gateway_settings([ups[0].url]))
    assert gw.runtime.tracing is None
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await client.post("/v1/chat/completions", json=chat("a"), headers={"traceparent": CLIENT_TRACEPARENT})
        await client.post("/v1/chat/completions", json=chat("b"))
    with_ctx, without = ups[0].state.seen
    assert with_ctx.headers["traceparent"] == CLIENT_TRACEPARENT  # forwarded as any client header
    assert "traceparent" not in without.headers


async def collector(port: int = 0) -> tuple[web.AppRunner, int, list[ExportTraceServiceRequest]]:
    """A fake OTLP/HTTP collector on `port` (0: any): its runner, its port, what it received."""
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1], received  # type: ignore[union-attr]


async def test_otlp_export_follows_otel_variables(
    upstreams: MakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The standard OTEL_* variables point the OTLP/HTTP exporter at a (here: fake) collector."""
    runner, port, received = await collector()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kvgate-under-test")
    ups = await upstreams(1)
    gw = await start_gateway(gateway_settings([ups[0].url], telemetry={"tracing": True}))
    try:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            assert (await client.post("/v1/chat/completions", json=chat("x"))).status_code == 200
    finally:
        await gw.stop()  # flushes the batch processor
        await runner.cleanup()
    names = {
        span.name
        for msg in received
        for rs in msg.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    }
    assert {"POST /v1/chat/completions", "queue", "route", "upstream"} <= names
    service = {
        a.value.string_value
        for msg in received
        for rs in msg.resource_spans
        for a in rs.resource.attributes
        if a.key == "service.name"
    }
    assert service == {"kvgate-under-test"}


def test_exporter_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,none,bogus")
    assert [type(e) for e in _exporters()] == [ConsoleSpanExporter]
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Tracing.from_config(TelemetryConfig(tracing=True)) is None
    assert Tracing.from_config(TelemetryConfig(tracing=False)) is None


async def test_no_collector_is_one_warning_not_one_per_batch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # no collector there yet
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    caplog.set_level(logging.INFO)
    tracing = Tracing("kvgate-under-test")

    def batch() -> None:
        with tracing.tracer.start_as_current_span("stage"):
            pass
        tracing.provider.force_flush()

    try:
        for _ in range(3):
            await asyncio.to_thread(batch)
        runner, _, received = await collector(port)
        try:
            await asyncio.to_thread(batch)
        finally:
            await runner.cleanup()
    finally:
        await asyncio.to_thread(tracing.provider.shutdown)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "OTEL_TRACES_EXPORTER=console" in warned[0].getMessage()
    assert warned[0].name == "gateway.observe.tracing"
    assert "works again" in caplog.text and received
