"""The access log: one line per request with ids and timings, never the prompt."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
import orjson
import pytest

from gateway.config import Settings
from gateway.logs import JsonFormatter, TextFormatter
from gateway.server import RunningGateway
from tests.conftest import gateway_settings
from tests.upstream_app import Upstream

MakeUpstreams = Callable[[int], Awaitable[list[Upstream]]]
MakeGateway = Callable[[Settings], Awaitable[RunningGateway]]

MARKER = "zebra-7f3a91-unique-prompt-marker"


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvgate.access"]


async def test_one_line_per_request_without_prompt_text(
    upstreams: MakeUpstreams, gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)  # every logger, as an operator's info-level log would hold
    ups = await upstreams(1)
    gw = await gateway(gateway_settings([ups[0].url], tenants=[{"name": "acme", "api_key": "sk-tenant-1"}]))
    auth = {"authorization": "Bearer sk-tenant-1"}
    async with httpx.AsyncClient(base_url=gw.url, headers=auth) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": f"say {MARKER}"}], "stream": True}
        r1 = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "req-stream-1"})
        assert r1.status_code == 200
        body = {"model": "m", "prompt": f"complete {MARKER}"}
        r2 = await client.post("/v1/completions", json=body, headers={"x-request-id": "req-plain-2"})
        assert r2.status_code == 200
        body = {"model": "missing", "prompt": MARKER}
        r3 = await client.post("/v1/completions", json=body, headers={"x-request-id": "req-404-3"})
        assert r3.status_code == 404

    lines = access_records(caplog)
    assert [r.fields["request_id"] for r in lines] == ["req-stream-1", "req-plain-2", "req-404-3"]  # type: ignore[attr-defined]
    stream, plain, missing = (r.fields for r in lines)  # type: ignore[attr-defined]
    assert stream["status"] == 200 and stream["stream"] is True and stream["pool"] == "p"
    assert stream["replica"] == "r0" and stream["tenant"] == "acme" and stream["retries"] == 0
    assert stream["ttft_ms"] > 0 and stream["total_ms"] >= stream["ttft_ms"] and stream["queue_ms"] >= 0
    assert stream["queue_ms"] <= stream["sent_ms"] <= stream["ttft_ms"]
    assert plain["endpoint"] == "completions" and plain["prompt_tokens"] > 0
    assert missing["status"] == 404 and missing["error"] == "model_not_found" and missing["ttft_ms"] is None
    assert missing["sent_ms"] is None  # never sent to an engine

    text, as_json = TextFormatter(), JsonFormatter()
    for record in caplog.records:  # the prompt reaches no log line at info level, in either format
        assert MARKER not in text.format(record) and MARKER not in as_json.format(record)
        assert "sk-tenant-1" not in text.format(record)
    line = text.format(lines[0])
    assert "request_id=req-stream-1" in line and "status=200" in line and "replica=r0" in line
    doc = orjson.loads(as_json.format(lines[1]))
    assert doc["logger"] == "kvgate.access" and doc["request_id"] == "req-plain-2" and doc["status"] == 200


async def test_access_log_can_be_turned_off(
    upstreams: MakeUpstreams, gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ups = await upstreams(1)
    gw = await gateway(gateway_settings([ups[0].url], server={"access_log": False}))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        body = {"model": "m", "prompt": "hi"}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert access_records(caplog) == []
