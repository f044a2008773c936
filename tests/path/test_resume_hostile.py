"""Mid-stream failover against hostile engines: for every way a stream can break after it began,
the answer is continued on the other replica and the client gets one whole stream, nothing
repeated; and what is not to be continued ends as before, with an error event.

Replica r0 breaks its stream in the case's way; r1 answers. Their answers' texts are
`<marker>:0`, `<marker>:1`, `<marker>:2`: a continuation that resent text would show it twice.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from tests.conftest import SERVER_IMPLS, wait_until
from tests.hostile_upstream import (
    TRANSPORTS,
    HostileUpstream,
    assert_settled,
    hostile_settings,
    marker,
    openai_error,
    sse_events,
)

CASES = {
    "close-mid-stream": "disconnected",
    "reset-mid-stream": "disconnected",
    "stall-body": "idle_timeout",
    "malformed-mid-stream": "malformed_event",
    "error-mid-stream": "engine_error",
    "end-mid-stream": "closed_early",
}


@pytest.fixture(params=SERVER_IMPLS)
def server_impl(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def pair():
    servers: list[HostileUpstream] = []

    async def make(mode: str) -> tuple[HostileUpstream, HostileUpstream]:
        servers.extend([await HostileUpstream(mode).start(), await HostileUpstream("ok").start()])
        return servers[0], servers[1]

    yield make
    for srv in servers:
        await srv.stop()


def _settings(urls: list[str], transport: str = "http1", **pool: object):
    # round_robin sends the first request to r0, the breaking one.
    return hostile_settings(urls, transport, pool={"policy": {"type": "round_robin"}, **pool})


def _texts(r: httpx.Response) -> tuple[list[str], set[str]]:
    events = sse_events(r)
    assert events[-1] == "[DONE]", events
    docs = [orjson.loads(e) for e in events[:-1]]
    assert all("error" not in d for d in docs), docs
    return [c["text"] for d in docs for c in d["choices"]], {d["id"] for d in docs}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", sorted(CASES))
async def test_a_broken_stream_is_continued_on_the_other_replica(
    mode: str, transport: str, pair, gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kvgate.access")
    broken, ok = await pair(mode)
    gw = await gateway(_settings([broken.url, ok.url], transport))
    mark = marker()
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "m", "prompt": mark, "max_tokens": 4, "stream": True}
        r = await c.post(gw.url + "/v1/completions", json=body)
        metrics = (await c.get(gw.url + "/metrics")).text
    assert r.status_code == 200
    texts, ids = _texts(r)
    assert "".join(texts) == f"{mark}:0{mark}:1{mark}:2"  # the seam: nothing twice, nothing lost
    assert ids == {f"cmpl-{mark}"}
    assert len(broken.deliveries) == 1 and len(ok.deliveries) == 1
    sent = orjson.loads(ok.deliveries[0].body)
    # No word boundary in what was sent: the continuation regenerates it all, and the budget stays.
    assert sent["prompt"] == mark and sent["max_tokens"] == 4
    assert f'kvgate_resumed_total{{pool="p",reason="{CASES[mode]}"}} 1.0' in metrics
    (line,) = [r.fields for r in caplog.records if r.name == "kvgate.access"]  # type: ignore[attr-defined]
    # Where it broke and why, where it ended; the continuation counts as a retry.
    assert line["resumed"] == [f"{CASES[mode]}@r0"] and line["replica"] == "r1" and line["retries"] == 1
    await assert_settled(gw)


@pytest.mark.parametrize("mode", ["reset-after-usage", "reset-after-done"])
async def test_an_answer_whose_stream_broke_after_it_was_whole_is_not_continued(
    mode: str, pair, gateway
) -> None:
    """Only the end was lost: the client gets one [DONE] after the whole answer, nothing twice."""
    broken, ok = await pair(mode)
    gw = await gateway(_settings([broken.url, ok.url]))
    mark = marker()
    async with httpx.AsyncClient(timeout=30) as c:
        body = {
            "model": "m",
            "prompt": mark,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = await c.post(gw.url + "/v1/completions", json=body)
    texts, _ = _texts(r)
    assert "".join(texts) == f"{mark}:0{mark}:1{mark}:2" and sse_events(r).count("[DONE]") == 1
    assert sum('"usage"' in e for e in sse_events(r)) == 1
    assert ok.deliveries == []
    await assert_settled(gw)


async def test_a_non_streamed_answer_is_asked_as_a_stream_and_continued(pair, gateway) -> None:
    broken, ok = await pair("reset-mid-stream")
    gw = await gateway(_settings([broken.url, ok.url], failover={"non_streamed": True}))
    mark = marker()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": mark, "max_tokens": 4})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["id"] == f"cmpl-{mark}" and doc["object"] == "text_completion"
    assert doc["choices"][0]["text"] == f"{mark}:0{mark}:1{mark}:2"
    first = orjson.loads(broken.deliveries[0].body)
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    await assert_settled(gw)


@pytest.mark.parametrize(
    ("extra", "headers", "pool"),
    [
        ({}, {"x-kvgate-no-resume": "1"}, {}),
        ({}, {}, {"failover": {"mid_stream": False}}),
        ({"n": 2}, {}, {}),
        ({"logprobs": 1}, {}, {}),
        ({"response_format": {"type": "json_object"}}, {}, {}),
    ],
    ids=["client-opt-out", "pool-off", "n2", "logprobs", "structured"],
)
async def test_what_is_not_continued_ends_with_the_error_event(
    extra: dict[str, object], headers: dict[str, str], pool: dict[str, object], pair, gateway
) -> None:
    broken, ok = await pair("error-mid-stream")
    gw = await gateway(_settings([broken.url, ok.url], **pool))
    mark = marker()
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "m", "prompt": mark, "max_tokens": 4, "stream": True, **extra}
        r = await c.post(gw.url + "/v1/completions", json=body, headers=headers)
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert orjson.loads(events[-2])["error"]["message"] == "engine dead: CUDA error"
    assert len(broken.deliveries) == 1 and ok.deliveries == []
    await assert_settled(gw)


async def test_with_no_other_replica_the_engine_error_is_relayed(
    pair, gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kvgate.access")
    broken, _ = await pair("reset-mid-stream")
    gw = await gateway(_settings([broken.url]))
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "m", "prompt": marker(), "max_tokens": 4, "stream": True}
        r = await c.post(gw.url + "/v1/completions", json=body)
        metrics = (await c.get(gw.url + "/metrics")).text
    # No continuation was sent, so none is counted (issue 35: 7 counted on a one-replica pool).
    assert "kvgate_resumed_total{" not in metrics
    (line,) = [r.fields for r in caplog.records if r.name == "kvgate.access"]  # type: ignore[attr-defined]
    assert "resumed" not in line and "no other replica to continue it" in caplog.text
    events = sse_events(r)
    err = orjson.loads(events[-1])["error"]
    assert err["code"] == "upstream_stream_error" and "mid-answer" in err["message"]
    assert [orjson.loads(e)["choices"][0]["text"] for e in events[:2]] == [
        f"{broken.markers()[0]}:{i}" for i in (0, 1)
    ]
    await assert_settled(gw)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_answer_on_a_replica_ejected_mid_stream_is_continued(transport: str, pair, gateway) -> None:
    """Health checks eject a replica whose stream went silent: the answer goes on elsewhere long
    before the idle timeout would have said anything."""
    broken, ok = await pair("stall-body")
    settings = hostile_settings(
        [broken.url, ok.url],
        "http1",
        upstream={"idle_timeout_s": 300},
        pool={"policy": {"type": "round_robin"}},
    )
    health = settings.health.model_copy(update={"enabled": True, "interval_s": 0.05})
    gw = await gateway(settings.model_copy(update={"health": health}))
    mark = marker()
    async with httpx.AsyncClient(timeout=60) as c:
        body = {"model": "m", "prompt": mark, "max_tokens": 4, "stream": True}
        asking = asyncio.ensure_future(c.post(gw.url + "/v1/completions", json=body))
        await wait_until(lambda: len(broken.deliveries) == 1, what="the answer under way on r0")
        broken.healthy = False
        r = await asking
        metrics = (await c.get(gw.url + "/metrics")).text
    texts, _ = _texts(r)
    assert "".join(texts) == f"{mark}:0{mark}:1{mark}:2"
    assert 'kvgate_resumed_total{pool="p",reason="ejected"} 1.0' in metrics
    await assert_settled(gw)


@pytest.mark.parametrize(("events", "continued"), [(8, True), (64, False)], ids=["below", "past"])
async def test_a_stream_past_max_kept_bytes_is_relayed_without_failover(
    events: int, continued: bool, pair, gateway
) -> None:
    """What failover keeps of a stream is bounded: past `failover.max_kept_bytes` the answer is
    relayed on (every byte of it) and a later break ends it with an error event, as without failover."""
    broken, ok = await pair("long-then-close")
    gw = await gateway(_settings([broken.url, ok.url], failover={"max_kept_bytes": 16384}))
    mark = marker()
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "m", "prompt": mark, "max_tokens": events, "stream": True}
        r = await c.post(gw.url + "/v1/completions", json=body)
        metrics = (await c.get(gw.url + "/metrics")).text
    sent = sse_events(r)
    texts = [orjson.loads(e)["choices"][0]["text"] for e in sent[:events]]
    assert [t[:5] for t in texts] == [f" {i:04d}" for i in range(events)]  # all of it, in order
    assert len(ok.deliveries) == (1 if continued else 0)
    blocked = 'kvgate_resume_blocked_total{pool="p",reason="too_long"} 1.0' in metrics
    assert blocked is not continued
    if not continued:
        assert orjson.loads(sent[-1])["error"]["code"] == "upstream_stream_error"
    await assert_settled(gw)


async def test_an_assembled_answer_is_bounded_by_max_response_bytes(pair, gateway) -> None:
    """A non-streamed answer assembled for failover is held to `upstream.max_response_bytes`
    (1 MiB here), as an answer read whole is: 502 past it, nothing assembled beyond."""
    broken, ok = await pair("long-then-close")
    gw = await gateway(_settings([broken.url, ok.url], failover={"non_streamed": True}))
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "m", "prompt": marker(), "max_tokens": 2048}  # 2 MiB of events
        r = await c.post(gw.url + "/v1/completions", json=body)
    assert r.status_code == 502
    assert openai_error(r)["code"] == "upstream_response_too_large"
    assert ok.deliveries == []
    await assert_settled(gw)


async def test_a_replica_killed_under_200_streams_has_every_one_continued(gateway) -> None:
    """Issue 35: with 200 streaming clients a kill broke 74 streams and the retry budget continued
    30 of them. A dead replica's streams are no retry storm: each is continued."""
    dying, ok = HostileUpstream("hold-then-reset"), HostileUpstream("ok")
    await dying.start()
    await ok.start()
    try:
        settings = hostile_settings(
            [dying.url, ok.url],
            "http1",
            # The held streams wait for the kill, not a timeout; continuations on a loaded machine
            # may wait for their head.
            upstream={"idle_timeout_s": 60, "first_byte_timeout_s": 30},
            retry={"budget_ratio": 0.2},  # the default: it continued 30 of 74 before
            pool={"policy": {"type": "round_robin"}},
        )
        gw = await gateway(settings)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=300)) as c:
            marks = [marker() for _ in range(200)]

            async def ask(mark: str) -> httpx.Response:
                body = {"model": "m", "prompt": mark, "max_tokens": 4, "stream": True}
                return await c.post(gw.url + "/v1/completions", json=body)

            asking = [asyncio.ensure_future(ask(m)) for m in marks]
            await wait_until(lambda: dying.held == 100, timeout=60, what="100 streams under way on r0")
            dying.release.set()  # r0 dies: every stream it held is cut
            answers = await asyncio.gather(*asking)
            metrics = (await c.get(gw.url + "/metrics")).text
        for mark, r in zip(marks, answers, strict=True):
            texts, _ = _texts(r)  # no error event, [DONE] at the end
            assert "".join(texts) == f"{mark}:0{mark}:1{mark}:2"
        assert 'kvgate_resumed_total{pool="p",reason="disconnected"} 100.0' in metrics
        await assert_settled(gw)
    finally:
        await dying.stop()
        await ok.stop()


async def test_a_continuation_that_times_out_before_its_first_byte_ends_the_stream_with_an_error_event(
    pair, gateway
) -> None:
    """A continuation's attempt that fails in a way no replica may repeat (the engine may be
    generating) ends the client's stream with an error event; it was raised as an HTTP error into
    the open stream, and the client read a status line where a chunk was due."""
    broken, stalled = (
        await HostileUpstream("close-mid-stream").start(),
        await HostileUpstream("stall-head").start(),
    )
    try:
        gw = await gateway(_settings([broken.url, stalled.url]))
        mark = marker()
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": "m", "prompt": mark, "max_tokens": 4, "stream": True}
            r = await c.post(gw.url + "/v1/completions", json=body)
        events = sse_events(r)
        assert [orjson.loads(e)["choices"][0]["text"] for e in events[:2]] == [f"{mark}:0", f"{mark}:1"]
        err = orjson.loads(events[-1])["error"]
        assert err["code"] == "upstream_stream_error" and "within" in err["message"]
        assert len(stalled.deliveries) == 1
        await assert_settled(gw)
    finally:
        await broken.stop()
        await stalled.stop()
