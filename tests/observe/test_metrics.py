"""Prometheus metrics: scraped from a real gateway with httpx, parsed with prometheus_client's parser."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission.scheduler import Scheduler
from gateway.config import SchedulerConfig, Settings
from gateway.observe.metrics import (
    QUEUE_BUCKETS,
    LoopFamily,
    RequestSeries,
    flatten_numbers,
    queued_by_class,
    status_label,
)
from gateway.path.request_record import RequestRecord
from gateway.server import RunningGateway
from tests.conftest import gateway_settings, wait_until
from tests.upstream_app import Upstream

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
MakeUpstreams = Callable[[int], Awaitable[list[Upstream]]]
MakeGateway = Callable[[Settings], Awaitable[RunningGateway]]


async def scrape(client: httpx.AsyncClient) -> Samples:
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of a series over every label set that contains `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def chat(text: str, stream: bool = False, model: str = "m") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}


async def test_request_series_move_with_traffic(upstreams: MakeUpstreams, gateway: MakeGateway) -> None:
    ups = await upstreams(2)
    settings = gateway_settings(
        [u.url for u in ups],
        routes=[{"model": "chat", "rules": [{"pools": [{"name": "p", "weight": 100}]}]}],
    )
    gw = await gateway(settings)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        before = await scrape(client)
        assert total(before, "kvgate_requests_total") == 0
        for i in range(4):
            assert (await client.post("/v1/chat/completions", json=chat(f"hi {i}", model="chat"))).is_success
        for i in range(2):
            r = await client.post("/v1/chat/completions", json=chat(f"yo {i}", stream=True))
            assert r.status_code == 200 and "[DONE]" in r.text
        assert (await client.post("/v1/chat/completions", json=chat("x", model="nope"))).status_code == 404
        after = await scrape(client)

    assert total(after, "kvgate_requests_total", pool="p", status="200") == 6
    assert total(after, "kvgate_requests_total", model="chat", endpoint="chat", status="200") == 4
    assert total(after, "kvgate_requests_total", model="m", status="200") == 2
    # round robin: both replicas served; an unknown model is not a label value of its own
    assert total(after, "kvgate_requests_total", replica="r0") == 3
    assert total(after, "kvgate_requests_total", replica="r1") == 3
    assert total(after, "kvgate_requests_total", model="other", pool="none", status="404") == 1
    assert total(after, "kvgate_time_to_first_byte_seconds_count", pool="p") == 6
    assert total(after, "kvgate_time_to_first_byte_seconds_count", stream="true") == 2
    assert total(after, "kvgate_request_duration_seconds_count") == 7
    assert total(after, "kvgate_queue_wait_seconds_count", pool="p", priority="default") == 6
    assert total(after, "kvgate_routing_decisions_total", pool="p", policy="round_robin") == 6
    assert total(after, "kvgate_prompt_tokens_total", pool="p") > 0
    assert total(after, "kvgate_estimated_cache_hit_ratio", pool="p") == 0.0
    assert total(after, "kvgate_replica_requests_total", pool="p") == 6
    assert total(after, "kvgate_rollout_weight", model="chat", rule="0", pool="p") == 100
    # request ids never become label values
    assert not any("request_id" in dict(ls) for _, ls in after)


async def test_retries_and_replica_gauges(upstreams: MakeUpstreams, gateway: MakeGateway) -> None:
    ups = await upstreams(2)
    gw = await gateway(gateway_settings([u.url for u in ups]))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        samples = await scrape(client)
        assert total(samples, "kvgate_replica_healthy", replica="r0", role="mixed", kind="vllm") == 1
        assert total(samples, "kvgate_replica_circuit_state", replica="r0", state="closed") == 1
        assert total(samples, "kvgate_replica_circuit_state", replica="r0", state="open") == 0
        assert total(samples, "kvgate_replica_inflight_requests", replica="r0") == 0

        ups[0].state.force_status = 503  # every request that lands on r0 first is retried on r1
        for i in range(4):
            assert (await client.post("/v1/chat/completions", json=chat(f"q{i}"))).status_code == 200
        samples = await scrape(client)
        assert total(samples, "kvgate_retries_total", pool="p") >= 1
        assert total(samples, "kvgate_requests_total", replica="r1", status="200") == 4

        ups[0].state.healthy = False
        await wait_until(lambda: not gw.runtime.pools["p"].replicas["r0"].healthy, what="r0 ejected")
        samples = await scrape(client)
        assert total(samples, "kvgate_replica_healthy", replica="r0") == 0
        assert total(samples, "kvgate_replica_available", replica="r0") == 0
        assert total(samples, "kvgate_replica_healthy", replica="r1") == 1


async def test_records_reasons_sheds_and_bounded_labels(
    upstreams: MakeUpstreams, gateway: MakeGateway
) -> None:
    """Fields that other components fill in (route and shed reasons, matched tokens) are counted
    as they come, and free-form values cannot blow up the label space."""
    ups = await upstreams(1)
    gw = await gateway(gateway_settings([ups[0].url]))
    rt = gw.runtime

    def record(**fields: object) -> RequestRecord:
        rec = RequestRecord("rid-secret-123", "chat", model="m", pool="p", priority_class="default")
        for k, v in fields.items():
            setattr(rec, k, v)
        rec.ended = rec.started + 0.05
        return rec

    rt.observe(
        record(replica="r0", status=200, prompt_tokens=100, matched_tokens=75, route_reason="cache_hit")
    )
    rt.observe(record(replica="r0", status=200, prompt_tokens=100, matched_tokens=0, route_reason="cold"))
    rt.observe(record(status=429, shed_reason="queue_full"))
    rt.observe(record(status=418))
    for i in range(50):
        rt.observe(record(replica="r0", status=200, prompt_tokens=0, route_reason=f"reason-{i}"))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        samples = await scrape(client)
    assert total(samples, "kvgate_routing_decisions_total", reason="cache_hit") == 1
    assert total(samples, "kvgate_routing_decisions_total", reason="cold") == 1
    assert total(samples, "kvgate_estimated_cache_hit_ratio", pool="p") == 0.375
    assert total(samples, "kvgate_prefix_matched_tokens_total", replica="r0") == 75
    assert (
        total(samples, "kvgate_shed_requests_total", pool="p", priority="default", reason="queue_full") == 1
    )
    assert total(samples, "kvgate_requests_total", status="429") == 1
    assert total(samples, "kvgate_requests_total", status="4xx") == 1
    reasons = {dict(ls)["reason"] for n, ls in samples if n == "kvgate_routing_decisions_total"}
    assert len(reasons) <= 33 and "other" in reasons
    assert not any("rid-secret-123" in v for _, ls in samples for _, v in ls)


async def test_metrics_can_be_turned_off(upstreams: MakeUpstreams, gateway: MakeGateway) -> None:
    ups = await upstreams(1)
    gw = await gateway(gateway_settings([ups[0].url], telemetry={"metrics": False}))
    assert gw.runtime.metrics is None
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.get("/metrics")).status_code == 404
        assert (await client.post("/v1/chat/completions", json=chat("hi"))).status_code == 200


def test_status_labels_are_a_small_fixed_set() -> None:
    assert [status_label(s) for s in (200, 201, 404, 418, 429, 499, 503, 507, 0)] == [
        "200",
        "2xx",
        "404",
        "4xx",
        "429",
        "499",
        "503",
        "5xx",
        "500",
    ]


def test_scheduler_stats_flatten_to_metric_keys() -> None:
    stats = Scheduler(SchedulerConfig()).stats()
    queued = {"interactive": 1, "batch": 2}
    stats["pools"]["p"] = {"queued": queued, "outstanding": 4, "outstanding_tokens": 0, "oldest_wait_s": 0.0}
    stats["shed"]["batch"]["queue_full"] = 5
    assert queued_by_class(stats, "p") == {"interactive": 1, "batch": 2}
    assert queued_by_class(stats, "unknown") == {}
    flat = flatten_numbers(stats)  # type: ignore[arg-type]
    assert flat["shed.batch.queue_full"] == 5 and flat["pools.p.outstanding"] == 4
    assert flat["priority_lowered"] == 0 and flat["wait_s.default.count"] == 0
    assert len(flatten_numbers({str(i): i for i in range(1000)}, limit=10)) == 10


def test_loop_series_expose_what_prometheus_clients_counter_and_histogram_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = LoopFamily("c", "a counter", ["pool", "replica"])
    histogram = LoopFamily("h", "a histogram", ["pool"], buckets=QUEUE_BUCKETS)
    ours.register(RequestSeries([counter, histogram]))
    ref_counter = Counter("c", "a counter", ["pool", "replica"], registry=theirs)
    ref_histogram = Histogram("h", "a histogram", ["pool"], buckets=QUEUE_BUCKETS, registry=theirs)
    # Bucket edges exactly, between them, beyond the last, zero and negative.
    amounts = [0.0, -1.0, 0.0005, 0.0007, 0.001, 0.3, 30.0, 31.0, 1e9, *QUEUE_BUCKETS]
    for i, amount in enumerate(amounts):
        labels = ("p", f"r{i % 3}")
        counter.labels(*labels).inc(i)
        ref_counter.labels(*labels).inc(i)
        histogram.labels(labels[1]).observe(amount)
        ref_histogram.labels(labels[1]).observe(amount)

    def text(registry: CollectorRegistry) -> str:
        return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())

    assert text(ours) == text(theirs)
    assert 'h_bucket{le="+Inf",pool="r0"}' in text(ours)
