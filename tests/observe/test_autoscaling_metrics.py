"""Per-pool autoscaling signals on /metrics: replicas by state, queue wait, KV usage, estimated TTFT."""

from __future__ import annotations

import asyncio

import httpx

from tests.conftest import gateway_settings, wait_until
from tests.observe.test_metrics import MakeGateway, MakeUpstreams, scrape


async def test_pool_signals_follow_drains_and_the_queue(
    upstreams: MakeUpstreams, gateway: MakeGateway
) -> None:
    a, b = await upstreams(2)
    # One request at a time per replica: with one replica drained, a second request queues.
    settings = gateway_settings([a.url, b.url], scheduler={"max_inflight_requests_per_replica": 1})
    gw = await gateway(settings)
    pool = gw.runtime.pools["p"]
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        body = {"model": "m", "prompt": "hello"}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        pool.replicas["r1"].draining = True
        m = await scrape(client)
        assert m[("kvgate_pool_replicas", frozenset({("pool", "p"), ("state", "available")}))] == 1
        assert m[("kvgate_pool_replicas", frozenset({("pool", "p"), ("state", "draining")}))] == 1
        assert m[("kvgate_pool_queue_oldest_wait_seconds", frozenset({("pool", "p")}))] == 0
        recent = m[("kvgate_pool_estimated_ttft_seconds", frozenset({("pool", "p")}))]
        assert 0 < recent < 1  # the request above, against an instant upstream

        # The only available replica holds its answer 1.5 s: the next request waits in the queue.
        slow = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"x-test-mode": "stall:1.5"})
        )
        await wait_until(lambda: pool.replicas["r0"].inflight_requests == 1, what="the slow request")
        queued = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_until(lambda: gw.runtime.scheduler.queue_depth().get("default", 0) == 1, what="queueing")
        await asyncio.sleep(0.3)  # the queued request ages: the signal must show its wait
        m = await scrape(client)
        oldest = m[("kvgate_pool_queue_oldest_wait_seconds", frozenset({("pool", "p")}))]
        assert oldest >= 0.3
        assert m[("kvgate_pool_estimated_ttft_seconds", frozenset({("pool", "p")}))] >= oldest
        assert (await slow).status_code == 200 and (await queued).status_code == 200
