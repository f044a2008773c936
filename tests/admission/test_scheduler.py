"""Scheduling: the queue's ordering on a virtual clock, and every admission path through a real gateway."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.scheduler import ClassQueue, Entry, PoolQueue, QueueFull
from gateway.config import PriorityClass, SchedulerConfig
from gateway.fleet.engine_load import EngineLoad
from gateway.path.request_record import RequestRecord
from gateway.server import RunningGateway
from tests.conftest import gateway_settings, wait_until

CHAT = "/v1/chat/completions"


def _entry(cost: int, t: float, seq: int, tenant: str | None = None) -> Entry:
    return Entry(cost=cost, tenant=tenant, enqueued=t, seq=seq)


def _class_queue(sjf: bool = True, aging_s: float = 10.0) -> ClassQueue:
    return ClassQueue(PriorityClass(name="c", level=1), sjf, aging_s)


def _drain(q: ClassQueue | PoolQueue, now: float) -> list[Any]:
    out = []
    while (e := q.pop(now)) is not None:
        out.append(e)
    return out


# -- ordering on a virtual clock --------------------------------------------------------------------------
def test_higher_class_first_then_shortest_job_first() -> None:
    q = PoolQueue(SchedulerConfig())
    q.push(_entry(10, 0.0, 0), "batch")
    q.push(_entry(500, 0.1, 1), "default")
    q.push(_entry(50, 0.2, 2), "default")
    q.push(_entry(900, 0.3, 3), "interactive")
    order = [(cls, e.cost) for e, cls in _drain(q, 1.0)]
    assert order == [("interactive", 900), ("default", 50), ("default", 500), ("batch", 10)]
    assert len(q) == 0


def test_fcfs_when_sjf_is_off() -> None:
    q = _class_queue(sjf=False)
    for i, cost in enumerate([500, 10, 100]):
        q.push(_entry(cost, float(i), i))
    assert [e.cost for e in _drain(q, 3.0)] == [500, 10, 100]


def test_aged_request_outranks_shorter_jobs() -> None:
    q = _class_queue(aging_s=5.0)
    q.push(_entry(10_000, 0.0, 0))
    # A steady stream of short jobs, one served per second: without aging the long one starves.
    served_long_at = None
    for t in range(20):
        q.push(_entry(1, float(t), t + 1))
        if q.pop(float(t)).cost == 10_000:  # type: ignore[union-attr]
            served_long_at = t
            break
    assert served_long_at == 5


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(1, 5000), st.sampled_from(["a", "b", "c"])),
            st.tuples(st.just("pop"), st.just(0), st.just("")),
            st.tuples(st.just("tick"), st.integers(1, 4), st.just("")),
        ),
        max_size=120,
    )
)
def test_aging_invariant_and_conservation(ops: list[tuple[str, int, str]]) -> None:
    """Whenever a queued request has waited the aging bound, the next pop is the oldest one; nothing
    is lost or served twice."""
    aging = 3.0
    q = _class_queue(aging_s=aging)
    now, seq = 0.0, 0
    queued: list[Entry] = []
    served: list[Entry] = []
    for op, arg, tenant in ops:
        if op == "push":
            e = _entry(arg, now, seq, tenant)
            seq += 1
            q.push(e)
            queued.append(e)
        elif op == "tick":
            now += arg
        else:
            e = q.pop(now)
            if not queued:
                assert e is None
                continue
            oldest = min(queued, key=lambda x: x.seq)
            if now - oldest.enqueued >= aging:
                assert e is oldest
            assert e in queued
            queued.remove(e)  # type: ignore[arg-type]
            served.append(e)  # type: ignore[arg-type]
        assert len(q) == len(queued)
    rest = _drain(q, now)
    assert sorted(x.seq for x in rest) == sorted(x.seq for x in queued)
    assert len({x.seq for x in served + rest}) == seq


@settings(max_examples=100, deadline=None)
@given(
    jobs=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 1000)), min_size=1, max_size=80)
)
def test_backlogged_tenants_stay_within_one_job_of_each_other(jobs: list[tuple[str, int]]) -> None:
    q = _class_queue()
    for seq, (tenant, cost) in enumerate(jobs):
        q.push(_entry(cost, 0.0, seq, tenant))
    left = Counter(t for t, _ in jobs)
    served: Counter[str] = Counter()
    biggest = max(c for _, c in jobs)
    while (e := q.pop(0.0)) is not None:
        served[e.tenant] += e.cost  # type: ignore[index]
        left[e.tenant] -= 1  # type: ignore[index]
        backlogged = [t for t in left if left[t] > 0]
        # Any two tenants that both still wait have been served within one job's tokens of each other.
        for t in backlogged:
            for u in backlogged:
                assert served[t] - served[u] <= biggest


def test_removals_and_compaction_keep_order_and_counts() -> None:
    q = _class_queue()
    entries = [_entry((i * 7919) % 1000, 0.0, i) for i in range(300)]
    for e in entries:
        q.push(e)
    for e in entries[::4] + entries[1::4] + entries[2::4]:
        q.remove(e)
    assert len(q) == 75
    rest = [e.seq for e in _drain(q, 0.0)]
    expected = sorted(entries[3::4], key=lambda e: (e.cost, e.seq))
    assert rest == [e.seq for e in expected]


def test_tenants_share_a_class_by_tokens() -> None:
    q = _class_queue()
    seq = 0
    for _ in range(50):
        q.push(_entry(100, 0.0, seq, "heavy"))
        seq += 1
    for _ in range(20):
        q.push(_entry(10, 0.0, seq, "light"))
        seq += 1
    first = [e.tenant for e in (q.pop(0.0) for _ in range(22))]
    # Equal tokens each: one heavy job (100) buys ten light ones (10 each).
    assert first.count("heavy") == 2 and first.count("light") == 20


def test_tenant_back_from_idle_gets_no_credit() -> None:
    q = _class_queue(sjf=False)
    for i in range(10):
        q.push(_entry(10, 0.0, i, "a"))
    _drain(q, 0.0)  # a used 100 tokens while b was idle
    for i in range(10, 14):
        q.push(_entry(10, 0.0, i, "a"))
        q.push(_entry(10, 0.0, i + 100, "b"))
    order = [e.tenant for e in _drain(q, 0.0)]
    assert order.count("a") == order.count("b") == 4
    assert "aaa" not in "".join(order) and "bbb" not in "".join(order)


def test_full_pool_sheds_newest_of_lowest_class() -> None:
    q = PoolQueue(SchedulerConfig(max_queue=3))
    batch_old, batch_new, default = _entry(1, 0, 0), _entry(1, 1, 1), _entry(1, 2, 2)
    assert q.push(batch_old, "batch") is None
    assert q.push(batch_new, "batch") is None
    assert q.push(default, "default") is None
    evicted = q.push(_entry(1, 3, 3), "interactive")
    assert evicted == (batch_new, "batch")
    assert q.push(_entry(1, 4, 4), "default") == (batch_old, "batch")
    with pytest.raises(QueueFull):  # nothing below `batch` to shed
        q.push(_entry(1, 5, 5), "batch")
    with pytest.raises(QueueFull):  # nothing below `default` left either
        q.push(_entry(1, 6, 6), "default")
    assert [cls for _, cls in _drain(q, 10.0)] == ["interactive", "default", "default"]


def test_class_bound() -> None:
    classes = [PriorityClass(name="hi", level=1, max_queue=1), PriorityClass(name="lo", level=0)]
    q = PoolQueue(SchedulerConfig(classes=classes, default_class="lo"))
    q.push(_entry(1, 0, 0), "hi")
    with pytest.raises(QueueFull):
        q.push(_entry(1, 0, 1), "hi")
    q.push(_entry(1, 0, 2), "lo")
    assert len(q) == 2


# -- through a real gateway --------------------------------------------------------------------------------
def _body(content: str = "x", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def _sched(**overrides: Any) -> dict[str, Any]:
    return {"max_inflight_requests_per_replica": 1, **overrides}


@contextlib.asynccontextmanager
async def _hold(c: httpx.AsyncClient, gw: RunningGateway, priority: str = "default") -> AsyncIterator[None]:
    """Occupy a slot with a stream the upstream never ends, until the block exits."""
    headers = {"x-test-mode": "hang-stream", "x-priority": priority}
    async with c.stream("POST", gw.url + CHAT, json=_body(stream=True), headers=headers) as r:
        assert r.status_code == 200
        chunks = r.aiter_bytes()
        await anext(chunks)  # not `async for ... break`: closing the iterator would close the stream
        yield


def _queued(gw: RunningGateway) -> int:
    return sum(gw.runtime.scheduler.stats()["queue_depth"].values())


def _records(gw: RunningGateway) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    gw.runtime.observers.append(records.append)
    return records


def _assert_shed(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert int(r.headers["retry-after"]) >= 1


async def test_fast_path_admits_without_queueing(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    async with httpx.AsyncClient() as c:
        rs = await asyncio.gather(*(c.post(gw.url + CHAT, json=_body()) for _ in range(5)))
    assert [r.status_code for r in rs] == [200] * 5
    stats = gw.runtime.scheduler.stats()
    assert stats["admitted"]["default"] == 5 and stats["queued_total"]["default"] == 0
    assert stats["pools"]["p"]["outstanding"] == 0


async def test_queued_requests_run_by_priority_when_capacity_frees(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], scheduler=_sched()))
    records = _records(gw)
    async with httpx.AsyncClient(timeout=10) as c:
        async with _hold(c, gw):
            batch = asyncio.create_task(
                c.post(gw.url + CHAT, json=_body("b"), headers={"x-priority": "batch"})
            )
            await wait_until(lambda: _queued(gw) == 1, what="batch queued")
            inter = asyncio.create_task(c.post(gw.url + CHAT, json=_body("i", priority="interactive")))
            await wait_until(lambda: _queued(gw) == 2, what="interactive queued")
            assert len(up.state.seen) == 1
        assert (await inter).status_code == 200 and (await batch).status_code == 200
    assert [s.body["messages"][0]["content"] for s in up.state.seen[1:]] == ["i", "b"]
    # The class name in body `priority` is the gateway's: engines expect an integer there.
    assert "priority" not in up.state.seen[1].body
    by_content = {r.priority_class: r for r in records if r.status == 200 and r.queued_s > 0}
    assert set(by_content) == {"interactive", "batch"}
    stats = gw.runtime.scheduler.stats()
    assert stats["queued_total"]["batch"] == 1 and stats["wait_s"]["batch"]["max"] > 0


async def test_engine_figures_gate_admission_and_the_recheck_wakes_the_queue(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    # kind "openai": nothing scrapes this replica, so the figures below stay as the test sets them.
    settings = gateway_settings(
        [up.url], pool={"endpoints": [{"url": up.url, "name": "r0", "kind": "openai"}]}
    )
    gw = await gateway(settings)
    replica = gw.runtime.pools["p"].replicas["r0"]
    replica.engine = EngineLoad(waiting=5, kv_usage=0.2, updated_at=time.monotonic())
    async with httpx.AsyncClient(timeout=10) as c:
        queued = asyncio.create_task(c.post(gw.url + CHAT, json=_body()))
        await wait_until(lambda: _queued(gw) == 1, what="queued on the engine's waiting figure")
        replica.engine = EngineLoad(waiting=0, kv_usage=0.99, updated_at=time.monotonic())
        # A new arrival re-checks headroom as it queues: with the KV cache full, both wait.
        second = asyncio.create_task(c.post(gw.url + CHAT, json=_body()))
        await wait_until(lambda: _queued(gw) == 2, what="second queued on KV usage")
        assert not up.state.seen
        replica.engine = EngineLoad(waiting=0, kv_usage=0.5, updated_at=time.monotonic())
        # Nothing is released; only the periodic re-check can notice the new figures.
        assert (await queued).status_code == 200 and (await second).status_code == 200
        # Stale figures are not trusted: the in-flight budget alone decides.
        replica.engine = EngineLoad(waiting=50, updated_at=time.monotonic() - 60)
        assert (await c.post(gw.url + CHAT, json=_body())).status_code == 200
    assert gw.runtime.scheduler.stats()["queued_total"]["default"] == 2


async def test_dispatches_since_a_full_engine_reported_count_as_waiting(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    settings = gateway_settings(
        [up.url], pool={"endpoints": [{"url": up.url, "name": "r0", "kind": "openai"}]}
    )
    gw = await gateway(settings)
    replica = gw.runtime.pools["p"].replicas["r0"]
    async with httpx.AsyncClient(timeout=10) as c, contextlib.AsyncExitStack() as holds:
        # An engine with an empty queue takes a burst: it is not throttled to a few per scrape.
        replica.engine = EngineLoad(waiting=0, updated_at=time.monotonic())
        for _ in range(6):
            await holds.enter_async_context(_hold(c, gw))
        # A full engine with 2 waiting: admitted while its queue is at most 4, counting what was sent
        # since it reported (2, 3, 4), so the fourth waits.
        replica.engine = EngineLoad(waiting=2, updated_at=time.monotonic())
        for _ in range(3):
            await holds.enter_async_context(_hold(c, gw))
        fourth = asyncio.create_task(c.post(gw.url + CHAT, json=_body()))
        await wait_until(lambda: _queued(gw) == 1, what="queued behind the engine's backlog")
        fourth.cancel()
    assert len(up.state.seen) == 9


async def test_slots_reserved_for_a_higher_class(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    classes = [
        {"name": "interactive", "level": 2, "reserved_per_replica": 1},
        {"name": "default", "level": 1},
        {"name": "batch", "level": 0},
    ]
    gw = await gateway(
        gateway_settings([up.url], scheduler=_sched(max_inflight_requests_per_replica=2, classes=classes))
    )
    async with httpx.AsyncClient(timeout=10) as c, _hold(c, gw, "batch"):
        # One slot left, and it is the interactive class's: a batch request waits for it...
        batch = asyncio.create_task(c.post(gw.url + CHAT, json=_body("b"), headers={"x-priority": "batch"}))
        await wait_until(lambda: _queued(gw) == 1, what="batch queued")
        # ...which an interactive request takes at once.
        r = await c.post(gw.url + CHAT, json=_body("i"), headers={"x-priority": "interactive"})
        assert r.status_code == 200 and _queued(gw) == 1 and not batch.done()
        batch.cancel()
    assert [s.body["messages"][0]["content"] for s in up.state.seen[1:]] == ["i"]


async def test_token_budget_admits_what_fits(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    sched = {"max_inflight_requests_per_replica": 10, "max_inflight_tokens_per_replica": 60}
    gw = await gateway(gateway_settings([up.url], scheduler=sched))
    async with httpx.AsyncClient(timeout=10) as c:
        async with _hold(c, gw):
            big = asyncio.create_task(c.post(gw.url + CHAT, json=_body("word " * 80)))
            await wait_until(lambda: _queued(gw) == 1, what="big prompt queued")
            # A small one still fits the token budget and, being the shorter job, goes first.
            assert (await c.post(gw.url + CHAT, json=_body("small"))).status_code == 200
            assert _queued(gw) == 1
        assert (await big).status_code == 200  # alone in flight, it runs even above the budget
    assert [s.body["messages"][0]["content"] for s in up.state.seen[1:]] == ["small", "word " * 80]


async def test_queue_full_is_429_with_retry_after(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], scheduler=_sched(max_queue=1)))
    records = _records(gw)
    async with httpx.AsyncClient(timeout=10) as c, _hold(c, gw):
        waiting = asyncio.create_task(c.post(gw.url + CHAT, json=_body()))
        await wait_until(lambda: _queued(gw) == 1, what="one queued")
        r = await c.post(gw.url + CHAT, json=_body())
        _assert_shed(r, 429, "queue_full")
        assert r.json()["error"]["type"] == "rate_limit_error"
        waiting.cancel()
    assert [rec.shed_reason for rec in records if rec.status == 429] == ["queue_full"]
    assert gw.runtime.scheduler.stats()["shed"]["default"]["queue_full"] == 1


async def test_queue_timeout_is_503_with_retry_after(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], scheduler=_sched(queue_timeout_s=0.2)))
    records = _records(gw)
    async with httpx.AsyncClient(timeout=10) as c, _hold(c, gw):
        r = await c.post(gw.url + CHAT, json=_body())
    _assert_shed(r, 503, "queue_timeout")
    assert len(up.state.seen) == 1  # only the held request reached the engine
    assert [rec.shed_reason for rec in records if rec.status == 503] == ["queue_timeout"]
    assert _queued(gw) == 0


async def test_lower_class_is_shed_for_a_higher_one(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], scheduler=_sched(max_queue=1)))
    async with httpx.AsyncClient(timeout=10) as c:
        async with _hold(c, gw):
            batch = asyncio.create_task(
                c.post(gw.url + CHAT, json=_body("b"), headers={"x-priority": "batch"})
            )
            await wait_until(lambda: _queued(gw) == 1, what="batch queued")
            inter = asyncio.create_task(
                c.post(gw.url + CHAT, json=_body("i"), headers={"x-priority": "interactive"})
            )
            _assert_shed(await batch, 429, "evicted")
            assert gw.runtime.scheduler.stats()["queue_depth"] == {"interactive": 1, "default": 0, "batch": 0}
        assert (await inter).status_code == 200
    assert [s.body["messages"][0]["content"] for s in up.state.seen[1:]] == ["i"]


async def test_client_leaving_the_queue_is_removed_at_once(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], scheduler=_sched()))
    records = _records(gw)
    async with httpx.AsyncClient(timeout=10) as c:
        async with _hold(c, gw):
            async with httpx.AsyncClient(timeout=10) as leaving:
                task = asyncio.create_task(leaving.post(gw.url + CHAT, json=_body("gone")))
                await wait_until(lambda: _queued(gw) == 1, what="queued")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await wait_until(lambda: _queued(gw) == 0, what="entry removed")
            assert gw.runtime.scheduler.stats()["cancelled_in_queue"]["default"] == 1
        # Capacity is free again and the next request runs; the one that left was never sent.
        assert (await c.post(gw.url + CHAT, json=_body("next"))).status_code == 200
    assert [s.body["messages"][0]["content"] for s in up.state.seen] == ["x", "next"]
    assert any(r.client_disconnected and r.replica is None for r in records)
    assert gw.runtime.scheduler.stats()["pools"]["p"]["outstanding"] == 0


async def test_a_job_is_sized_by_all_the_answers_it_asks_for(upstreams, gateway) -> None:
    """n x prompts: a request for 8 choices waits behind one for 1 of the same size (shortest job
    first), and is charged 8 outputs against a tenant's tokens a minute."""
    (up,) = await upstreams(1)
    tenants = [{"name": "tpm", "api_key": "k-tpm", "tokens_per_min": 600}, {"name": "free", "api_key": "k"}]
    gw = await gateway(gateway_settings([up.url], scheduler=_sched(), tenants=tenants))
    async with httpx.AsyncClient(timeout=10, headers={"authorization": "Bearer k"}) as c:
        async with _hold(c, gw):
            many = asyncio.create_task(c.post(gw.url + CHAT, json=_body("many", n=8, max_tokens=100)))
            await wait_until(lambda: _queued(gw) == 1, what="the n=8 request queued")
            one = asyncio.create_task(c.post(gw.url + CHAT, json=_body("one", n=1, max_tokens=100)))
            await wait_until(lambda: _queued(gw) == 2, what="the n=1 request queued")
        assert (await one).status_code == 200 and (await many).status_code == 200
        assert [s.body["messages"][0]["content"] for s in up.state.seen[1:]] == ["one", "many"]
        tpm = {"authorization": "Bearer k-tpm"}
        assert (await c.post(gw.url + CHAT, json=_body(n=8, max_tokens=100), headers=tpm)).status_code == 200
        # That was 800 output tokens and more, past the 600 a minute (not 100): the next must wait.
        r = await c.post(gw.url + CHAT, json=_body(max_tokens=100), headers=tpm)
        _assert_shed(r, 429, "rate_limit_tokens")


async def test_tenant_rate_limits_are_429_with_retry_after(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    tenants = [
        {"name": "rps", "api_key": "k-rps", "requests_per_s": 1},
        {"name": "tpm", "api_key": "k-tpm", "tokens_per_min": 600},
    ]
    gw = await gateway(gateway_settings([up.url], tenants=tenants))
    records = _records(gw)
    async with httpx.AsyncClient(timeout=10) as c:
        rps = {"authorization": "Bearer k-rps"}
        assert (await c.post(gw.url + CHAT, json=_body(), headers=rps)).status_code == 200
        _assert_shed(await c.post(gw.url + CHAT, json=_body(), headers=rps), 429, "rate_limit_requests")
        tpm = {"authorization": "Bearer k-tpm"}
        assert (await c.post(gw.url + CHAT, json=_body(max_tokens=400), headers=tpm)).status_code == 200
        r = await c.post(gw.url + CHAT, json=_body(max_tokens=400), headers=tpm)
        _assert_shed(r, 429, "rate_limit_tokens")
        # About 400 of 600 tokens a minute are missing: tens of seconds, not one.
        assert 20 <= int(r.headers["retry-after"]) <= 60
    assert len(up.state.seen) == 2
    assert sorted(r.shed_reason for r in records if r.shed_reason) == [
        "rate_limit_requests",
        "rate_limit_tokens",
    ]


async def test_tenant_above_its_class_is_lowered(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    tenants = [{"name": "t", "api_key": "k", "max_priority": "batch"}]
    gw = await gateway(gateway_settings([up.url], tenants=tenants))
    records = _records(gw)
    async with httpx.AsyncClient() as c:
        r = await c.post(
            gw.url + CHAT, json=_body(), headers={"authorization": "Bearer k", "x-priority": "interactive"}
        )
    assert r.status_code == 200
    assert records[0].priority_class == "batch" and records[0].tenant == "t"
    assert gw.runtime.scheduler.stats()["priority_lowered"] == 1


async def test_prompt_too_large_is_400(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], scheduler={"max_prompt_tokens": 20}))
    records = _records(gw)
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + CHAT, json=_body("word " * 100))
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_large"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert records[0].shed_reason == "prompt_too_large" and not up.state.seen


async def test_window_policy_trims_oldest_turns_before_sending(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    tenants = [{"name": "t", "api_key": "k", "max_prompt_tokens": 60, "prompt_overflow": "window"}]
    gw = await gateway(gateway_settings([up.url], tenants=tenants))
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(6):
        messages += [
            {"role": "user", "content": f"question {i} " + "lorem " * 8},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    messages.append({"role": "user", "content": "final question"})
    async with httpx.AsyncClient() as c:
        r = await c.post(
            gw.url + CHAT, json={"model": "m", "messages": messages}, headers={"authorization": "Bearer k"}
        )
    assert r.status_code == 200
    sent = up.state.seen[0].body["messages"]
    assert sent[0] == messages[0] and sent[-1] == messages[-1]
    assert 3 <= len(sent) < len(messages)
    assert sent[1:] == messages[len(messages) - len(sent) + 1 :]  # a contiguous run of the newest turns
    assert sent[1]["role"] == "user"
    assert gw.runtime.scheduler.stats()["prompts_trimmed"] == 1


@pytest.mark.parametrize(("kind", "expected"), [("vllm", -2), ("sglang", 2), ("sim", -2)])
async def test_priority_forwarded_in_the_engines_direction(upstreams, gateway, kind, expected) -> None:
    (up,) = await upstreams(1)
    settings = gateway_settings(
        [up.url], pool={"priority_scheduling": True, "endpoints": [{"url": up.url, "kind": kind}]}
    )
    gw = await gateway(settings)
    async with httpx.AsyncClient() as c:
        await c.post(gw.url + CHAT, json=_body(), headers={"x-priority": "interactive"})
        await c.post(gw.url + CHAT, json=_body(priority="batch"))
        await c.post(gw.url + CHAT, json=_body(priority=7), headers={"x-priority": "interactive"})
    assert [s.body.get("priority") for s in up.state.seen] == [expected, 0, 7]


async def test_no_priority_field_without_priority_scheduling(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    async with httpx.AsyncClient() as c:
        await c.post(gw.url + CHAT, content=raw, headers={"x-priority": "interactive"})
    assert up.state.seen[0].raw == raw  # untouched, byte for byte


async def test_unknown_priority_class_is_a_clear_400_and_the_gateway_keeps_serving(
    upstreams, gateway
) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + CHAT, json=_body(), headers={"x-priority": "urgent"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "invalid_priority"
        assert "'urgent'" in error["message"] and "interactive" in error["message"]
        assert not up.state.seen  # never forwarded
        ok = await c.post(gw.url + CHAT, json=_body(), headers={"x-priority": "batch"})
        assert ok.status_code == 200


async def test_shutdown_answers_queued_requests_503_instead_of_dropping_them(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], scheduler=_sched(), server={"grace_period_s": 1}))
    async with httpx.AsyncClient(timeout=10) as c:
        async with _hold(c, gw):  # the only slot stays busy past the grace period
            queued = asyncio.create_task(c.post(gw.url + CHAT, json=_body("q")))
            await wait_until(lambda: _queued(gw) == 1, what="a queued request")
            stopping = asyncio.create_task(gw.stop())
            _assert_shed(await queued, 503, "shutting_down")
            await stopping
    assert gw.runtime.scheduler.stats()["shed"]["default"]["shutting_down"] == 1
    assert [s.body["messages"][0]["content"] for s in up.state.seen] == ["x"]  # only the held one went up
