"""The streaming client and the load generator against a real loopback engine (tests.bench.stub_engine)."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from bench import loadgen
from bench.client import STATUS_CONNECT_ERROR, ClientOptions, RequestRecord, send
from bench.loadgen import LoadSpec
from bench.workloads import BenchRequest, make_workload
from tests.bench import stub_engine
from tests.conftest import free_port

Stub = tuple[stub_engine.StubState, str]


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    state = stub_engine.StubState("m", ttft_ms=1.0, itl_ms=1.0)
    runner, port = await stub_engine.start(state)
    yield state, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def request(index: int = 0, content: str = " hello world", **kw: object) -> BenchRequest:
    base: dict[str, object] = {
        "index": index,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        "prompt_tokens": 2,
    }
    base.update(kw)
    return BenchRequest(**base)  # type: ignore[arg-type]


def record(req: BenchRequest) -> RequestRecord:
    return RequestRecord(index=req.index, kind=req.kind, priority=req.priority, group=req.group, target="")


async def test_ttft_itl_usage_and_headers(stub: Stub) -> None:
    state, url = stub
    opts = ClientOptions(model="m", extra_headers={"x-stub-ttft-ms": "80", "x-stub-itl-ms": "20"})
    req = request(priority="interactive", group="g7")
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        r = await send(session, url, req, opts, record(req), t0)
    assert r.ok and r.status == 200 and r.error is None
    assert r.ttft is not None and r.ttft >= 0.08
    assert len(r.itls) == 4
    assert r.e2e is not None and r.e2e >= r.ttft + sum(r.itls) - 1e-6
    # Causality, token by token: the client saw each token no earlier than the server sent it
    # (a gap-by-gap lower bound would flake whenever one chunk is read late and the next on time).
    seen = t0 + (r.sent or 0) + r.ttft
    for k, server_sent in enumerate(state.token_times[0]):
        seen += r.itls[k - 1] if k else 0.0
        assert seen >= server_sent
    assert r.output_tokens == 5 and r.prompt_tokens == 2 and r.cached_tokens == 0
    assert r.replica == url  # no gateway header: the target is the replica
    sent = state.requests[0]
    assert sent["headers"]["x-priority"] == "interactive"
    assert sent["headers"]["x-kvgate-group"] == "g7"
    assert sent["body"]["stream"] is True and sent["body"]["stream_options"] == {"include_usage": True}
    assert sent["body"]["ignore_eos"] is True and sent["body"]["max_tokens"] == 5


async def test_cached_tokens_parsed_from_usage(stub: Stub) -> None:
    _, url = stub
    text = make_workload("shared-prefix", {"groups": 1, "prompts_per_group": 1, "system_tokens": 100}).build(
        0
    )
    req = request(content=text[0].prompt_text())
    opts = ClientOptions(model="m", api="completions")
    async with aiohttp.ClientSession() as session:
        first = await send(session, url, req, opts, record(req), time.perf_counter())
        second = await send(session, url, req, opts, record(req), time.perf_counter())
    assert first.ok and second.ok
    assert first.cached_tokens == 0
    assert first.prompt_tokens == 228
    assert second.cached_tokens == 224  # 14 full 16-token blocks


async def test_error_status_and_connection_failure_are_recorded(
    stub: Stub,
) -> None:
    _, url = stub
    req = request()
    async with aiohttp.ClientSession() as session:
        busy = await send(
            session,
            url,
            req,
            ClientOptions(model="m", extra_headers={"x-stub-status": "429", "x-stub-retry-after": "3"}),
            record(req),
            0.0,
        )
        failed = await send(
            session,
            url,
            req,
            ClientOptions(model="m", extra_headers={"x-stub-status": "503"}),
            record(req),
            0.0,
        )
        refused = await send(
            session, f"http://127.0.0.1:{free_port()}", req, ClientOptions("m"), record(req), 0.0
        )
    assert busy.status == 429 and not busy.ok and busy.error == "stub says 429"
    assert busy.retry_after == "3" and failed.status == 503 and failed.retry_after is None
    assert refused.status == STATUS_CONNECT_ERROR and not refused.ok and refused.error


async def test_open_loop_run_sends_every_request_round_robin(stub: Stub) -> None:
    state, url = stub
    state2 = stub_engine.StubState("m", ttft_ms=1.0, itl_ms=1.0)
    runner2, port2 = await stub_engine.start(state2)
    url2 = f"http://127.0.0.1:{port2}"
    try:
        reqs = make_workload("prefix-repetition", {"num_requests": 12, "prefix_tokens": 32}).build(0)
        load = LoadSpec(rate=200.0, warmup_requests=2, seed=1)
        result = await loadgen.run(reqs, load, [url, url2], ClientOptions("m", extra_headers={}))
    finally:
        await runner2.cleanup()
    assert [r.index for r in result.records] == list(range(12))
    assert all(r.ok for r in result.records)
    assert sum(r.warmup for r in result.records) == 2
    assert {r.replica for r in result.records} == {url, url2}
    assert len(state.requests) == len(state2.requests) == 6
    # Open loop: a request is never sent before its scheduled time.
    assert all((r.sent or 0) >= r.scheduled for r in result.records)
    assert result.offered_rate == 200.0 and result.unsent == 0
    assert result.notes == []


async def test_a_workload_shorter_than_the_duration_is_noted(stub: Stub) -> None:
    _, url = stub
    result = await loadgen.run([request(i) for i in range(3)], LoadSpec(rate=100.0, duration_s=30.0), [url],
                               ClientOptions("m"))  # fmt: skip
    assert len(result.records) == 3 and result.unsent == 0
    assert any("ran out after" in n for n in result.notes)


async def test_closed_loop_keeps_at_most_c_in_flight(stub: Stub) -> None:
    _, url = stub
    reqs = [request(i) for i in range(9)]
    result = await loadgen.run(reqs, LoadSpec(mode="closed", concurrency=2), [url], ClientOptions("m"))
    assert all(r.ok for r in result.records)
    intervals = [(r.sent or 0.0, (r.sent or 0.0) + (r.e2e or 0.0)) for r in result.records]
    for start, _ in intervals:
        assert sum(1 for s, e in intervals if s <= start < e) <= 2


async def test_next_turn_waits_for_the_previous_one(stub: Stub) -> None:
    _, url = stub
    reqs = make_workload(
        "multi-turn", {"sessions": 2, "turns": 3, "system_tokens": 16, "output_tokens": 4}
    ).build(0)
    result = await loadgen.run(reqs, LoadSpec(rate=1000.0), [url], ClientOptions("m"))
    by_index = {r.index: r for r in result.records}
    for req in reqs:
        if req.depends_on is not None:
            dep = by_index[req.depends_on]
            assert (by_index[req.index].sent or 0) >= (dep.sent or 0) + (dep.e2e or 0) - 1e-3


def test_bursty_schedule_alternates_high_and_low_phases_around_the_mean() -> None:
    reqs = [request(i) for i in range(4000)]
    load = LoadSpec(rate=10.0, seed=1, burst_period_s=10.0)
    times = loadgen.schedule(reqs, load)
    assert times == loadgen.schedule(reqs, load) and all(x < y for x, y in itertools.pairwise(times))
    assert (len(times) - 1) / times[-1] == pytest.approx(10.0, rel=0.1)
    on = 0.8 / 1.8 * 10.0  # 2x for `on` seconds and 0.2x for the rest average 1x
    high = sum(1 for t in times if t % 10.0 < on) / (times[-1] * on / 10.0)
    low = sum(1 for t in times if t % 10.0 >= on) / (times[-1] * (10.0 - on) / 10.0)
    assert high == pytest.approx(20.0, rel=0.1) and low == pytest.approx(2.0, rel=0.2)
    with pytest.raises(ValueError):
        LoadSpec(mode="closed", concurrency=4, burst_period_s=10.0)


def test_poisson_schedule_is_seeded_and_cut_by_duration() -> None:
    reqs = [request(i) for i in range(2000)]
    a = loadgen.schedule(reqs, LoadSpec(rate=50.0, seed=3))
    assert a == loadgen.schedule(reqs, LoadSpec(rate=50.0, seed=3))
    assert a != loadgen.schedule(reqs, LoadSpec(rate=50.0, seed=4))
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert (len(a) - 1) / a[-1] == pytest.approx(50.0, rel=0.1)
    cut = loadgen.schedule(reqs, LoadSpec(rate=50.0, seed=3, duration_s=5.0))
    assert cut == [t for t in a if t < 5.0]
    traced = loadgen.schedule([request(i, at=10.0 + i) for i in range(3)], LoadSpec(mode="trace"))
    assert traced == [0.0, 1.0, 2.0]
