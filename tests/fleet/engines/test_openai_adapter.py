"""Any OpenAI-compatible server (`kind: openai`), the smallest engine adapter: end to end, a pool of
them gets the gateway's retries before the first byte, and nothing that needs an engine's own
dialect: no continuation of a broken answer, no load scraping, no `priority` field."""

from __future__ import annotations

import httpx
import orjson
import pytest

from gateway.fleet.engines import OpenAIAdapter, get_adapter
from tests.hostile_upstream import HostileUpstream, assert_settled, hostile_settings, marker, sse_events


def test_an_openai_server_has_no_dialect_of_its_own() -> None:
    adapter = get_adapter("openai")
    assert isinstance(adapter, OpenAIAdapter)
    assert adapter.connector is None and not adapter.continues and adapter.load_path is None
    assert not adapter.schedules_by_priority and not adapter.control_fields
    assert adapter.lora_model("base", "a") == "a"


@pytest.fixture
async def engines():
    started: list[HostileUpstream] = []

    async def make(*modes: str) -> list[HostileUpstream]:
        started.extend([await HostileUpstream(m).start() for m in modes])
        return started

    yield make
    for srv in started:
        await srv.stop()


def _settings(servers: list[HostileUpstream]):
    endpoints = [{"url": s.url, "name": f"r{i}", "kind": "openai"} for i, s in enumerate(servers)]
    return hostile_settings([], "http1", pool={"policy": {"type": "round_robin"}, "endpoints": endpoints})


async def test_a_broken_answer_is_not_continued_and_a_refusal_is_retried(engines, gateway) -> None:
    broken, ok = await engines("close-mid-stream", "ok")
    gw = await gateway(_settings([broken, ok]))
    assert gw.runtime.fleet.scraper._targets == {}  # no load figures to read from such a server
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "m", "prompt": marker(), "max_tokens": 4, "stream": True, "priority": 3}
        r = await c.post(gw.url + "/v1/completions", json=body)
    events = sse_events(r)
    # The failover of other engines would have continued it on r1: here the client is told.
    assert orjson.loads(events[-1])["error"]["code"] == "upstream_stream_error"
    assert ok.deliveries == []
    assert "priority" not in orjson.loads(broken.deliveries[0].body)  # no engine to read it
    await assert_settled(gw)


async def test_a_refusal_before_the_first_byte_goes_to_the_next_server(engines, gateway) -> None:
    busy, ok = await engines("status-503", "ok")
    gw = await gateway(_settings([busy, ok]))
    mark = marker()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": mark, "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "r1"
    assert busy.markers() == [mark] and ok.markers() == [mark]
    await assert_settled(gw)
