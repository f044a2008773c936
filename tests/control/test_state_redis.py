"""Redis-shared state between real gateway instances: prefix index, in-flight load, weights, counters,
and what happens when Redis goes away and comes back (on a redis-server this test starts itself)."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis
import redis.asyncio as aioredis

from gateway.config import load_config
from gateway.control.state import Bucket
from gateway.control.state.redis_backend import SharedPrefixIndex, dedupe
from gateway.routing.prefix_index import PrefixIndex
from gateway.runtime import Runtime
from gateway.server import RunningGateway
from tests.conftest import free_port, gateway_settings, wait_until

REDIS_URL = "redis://127.0.0.1:6379/0"
KEY = "admin-secret"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module", autouse=True)
def _redis_reachable() -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis reachable at {REDIS_URL}: {exc}")


@pytest.fixture
async def key_prefix() -> AsyncIterator[str]:
    prefix = f"kvgate-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


# How long a change may take to reach another instance here: sync intervals are 0.05 s (30 s
# where a test shows a change arriving without waiting for one), so this only bounds a loaded
# machine's pauses.
LOADED = 10.0


def shared_settings(
    endpoints: list[str], prefix: str, redis_url: str = REDIS_URL, sync_interval_s: float = 0.05, **extra: Any
) -> Any:
    return gateway_settings(
        endpoints,
        control={"admin_key": KEY},
        state={
            "backend": "redis",
            "redis_url": redis_url,
            "key_prefix": prefix,
            "sync_interval_s": sync_interval_s,
            "instance_ttl_s": 1.0,
        },
        **extra,
    )


def prompt(group: int) -> str:
    # Long enough for many 64-character prefix blocks; distinct from the first character on.
    return f"group {group}: " + " ".join(f"shared-context-{group}-{i}" for i in range(150))


async def complete(
    client: httpx.AsyncClient, gw: RunningGateway, text: str, **headers: str
) -> httpx.Response:
    r = await client.post(gw.url + "/v1/completions", json={"model": "m", "prompt": text}, headers=headers)
    assert r.status_code == 200, r.text
    return r


def blocks(gw: RunningGateway) -> int:
    return int(gw.runtime.routers["p"].match.index.stats()["distinct_blocks"])  # type: ignore[call-overload]


async def test_two_instances_send_a_prefix_to_the_same_replica(key_prefix, upstreams, gateway) -> None:
    ups = await upstreams(4)
    pool = {"policy": {"type": "prefix_affinity"}}
    a = await gateway(shared_settings([u.url for u in ups], key_prefix, pool=pool))
    b = await gateway(shared_settings([u.url for u in ups], key_prefix, pool=pool))
    groups = range(8)
    async with httpx.AsyncClient() as client:
        first = {g: (await complete(client, a, prompt(g))).headers["x-kvgate-replica"] for g in groups}
        assert len(set(first.values())) == 4  # cold prefixes spread over the replicas
        await wait_until(lambda: blocks(b) == blocks(a) > 0, timeout=5, what="B to learn A's prefixes")
        # B sees them in another order: without shared state its own rotation would differ.
        second = {
            g: (await complete(client, b, prompt(g))).headers["x-kvgate-replica"] for g in reversed(groups)
        }
    assert second == first


async def test_learned_blocks_reach_peers_without_waiting_for_the_sync_interval(
    key_prefix, upstreams, gateway
) -> None:
    (up,) = await upstreams(1)
    a = await gateway(shared_settings([up.url], key_prefix, sync_interval_s=30))
    b = await gateway(shared_settings([up.url], key_prefix, sync_interval_s=30))
    async with httpx.AsyncClient() as client:
        for g in range(3):
            await complete(client, a, prompt(g))
            await wait_until(lambda: blocks(b) == blocks(a), timeout=LOADED, what="B to learn at once")


async def test_remote_inflight_visible_and_expires_with_a_dead_instance(
    key_prefix, upstreams, gateway
) -> None:
    (up,) = await upstreams(1)
    a = await gateway(shared_settings([up.url], key_prefix))
    b = await gateway(shared_settings([up.url], key_prefix))
    ra, rb = a.runtime.pools["p"].replicas["r0"], b.runtime.pools["p"].replicas["r0"]
    async with httpx.AsyncClient(timeout=10) as client:
        # Stalled past any wait here, then given up by its client: its end must reach B too.
        slow = asyncio.create_task(complete(client, a, "x" * 400, **{"x-test-mode": "stall:120"}))
        await wait_until(
            lambda: rb.remote_inflight_requests == 1, timeout=LOADED, what="B to see A's request"
        )
        assert rb.remote_inflight_tokens == ra.inflight_tokens > 0
        assert rb.inflight_requests == 0 and ra.remote_inflight_requests == 0  # own and others' apart
        slow.cancel()
        await wait_until(
            lambda: rb.remote_inflight_requests == 0, timeout=LOADED, what="A's request to end on B"
        )
        # A gateway that dies mid-request (its sync stops) stops counting once its TTL (1 s) runs
        # out. The request outlasts any wait here, so that it is still in flight when B forgets it.
        slow = asyncio.create_task(complete(client, a, "x" * 400, **{"x-test-mode": "stall:120"}))
        try:
            await wait_until(
                lambda: rb.remote_inflight_requests == 1, timeout=LOADED, what="B to see A's request"
            )
            task = a.runtime.state._tasks[0]  # type: ignore[attr-defined]  # its sync loop
            task.cancel()
            await wait_until(
                lambda: rb.remote_inflight_requests == 0, timeout=LOADED, what="A's counts to expire"
            )
            assert ra.inflight_requests == 1
        finally:
            slow.cancel()


async def test_weight_change_on_one_instance_reaches_the_other(key_prefix, upstreams, gateway) -> None:
    from tests.routing.test_rollout import rollout_settings

    s, c = await upstreams(2)
    state = {"backend": "redis", "key_prefix": key_prefix, "sync_interval_s": 0.05}
    a = await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}, state=state))
    b = await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}, state=state))
    await wait_until(lambda: a.runtime.state.connected and b.runtime.state.connected, what="both connected")
    async with httpx.AsyncClient() as client:
        r = await client.put(
            a.control_url + "/admin/routes/llama/weights", json={"weights": {"canary": 0}}, headers=AUTH
        )
        assert r.status_code == 200
        await wait_until(
            lambda: b.runtime.rollouts.weights("llama") == {"stable": 50.0, "canary": 0.0},
            timeout=LOADED,
            what="the rollback on B",
        )
        for i in range(20):
            r = await client.post(
                b.url + "/v1/completions",
                json={"model": "llama", "prompt": "x"},
                headers={"x-user-id": f"u{i}"},
            )
            assert r.headers["x-kvgate-pool"] == "stable"
        # A third instance started later adopts the fleet's weights, not its file's.
        late = await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}, state=state))
        await wait_until(
            lambda: late.runtime.rollouts.weights("llama") == {"stable": 50.0, "canary": 0.0},
            timeout=LOADED,
            what="the late instance to adopt the weights",
        )
        audit = (await client.get(a.control_url + "/admin/audit", headers=AUTH)).json()["changes"]
        assert "weights" in audit[-1]["what"]


async def test_shared_weights_out_of_bounds_are_not_applied(key_prefix, upstreams, gateway, caplog) -> None:
    """Whatever writes the shared weights, an instance holds them to the file's bounds."""
    from tests.routing.test_rollout import rollout_settings

    s, c = await upstreams(2)
    state = {"backend": "redis", "key_prefix": key_prefix, "sync_interval_s": 0.05}
    gw = await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}, state=state))
    await wait_until(lambda: gw.runtime.state.connected, what="connected")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        raw = orjson.dumps({"weights": {"stable": 1e308, "canary": 1e308}, "by": "someone", "at": 0})
        await client.hset(f"{key_prefix}:weights", "llama\t1", raw)
        await wait_until(
            lambda: "shared weights for route llama rule 1 not applied: a weight is 0" in caplog.text,
            timeout=LOADED,
            what="the refusal",
        )
    finally:
        await client.aclose()
    assert gw.runtime.rollouts.weights("llama") == {"stable": 50.0, "canary": 50.0}


async def test_drain_on_one_instance_drains_everywhere(key_prefix, upstreams, gateway) -> None:
    ups = await upstreams(2)
    a = await gateway(shared_settings([u.url for u in ups], key_prefix))
    b = await gateway(shared_settings([u.url for u in ups], key_prefix))
    rb = b.runtime.pools["p"].replicas["r0"]
    async with httpx.AsyncClient() as client:
        r = await client.post(a.control_url + "/admin/pools/p/replicas/r0/drain", headers=AUTH)
        assert r.status_code == 200
        await wait_until(lambda: rb.draining, timeout=LOADED, what="B to drain r0")
        for _ in range(4):
            assert (await complete(client, b, "x")).headers["x-kvgate-replica"] == "r1"
        late = await gateway(shared_settings([u.url for u in ups], key_prefix))
        await wait_until(
            lambda: late.runtime.pools["p"].replicas["r0"].draining,
            timeout=LOADED,
            what="late instance drains",
        )
        r = await client.post(b.control_url + "/admin/pools/p/replicas/r0/undrain", headers=AUTH)
        assert r.status_code == 200
        ra = a.runtime.pools["p"].replicas["r0"]
        await wait_until(lambda: not ra.draining, timeout=LOADED, what="A to undrain r0")


async def test_endpoints_added_or_removed_on_one_instance_change_every_instance(
    key_prefix, upstreams, gateway
) -> None:
    first, added = await upstreams(2)
    a = await gateway(shared_settings([first.url], key_prefix))
    b = await gateway(shared_settings([first.url], key_prefix))
    pool_b = b.runtime.pools["p"]
    async with httpx.AsyncClient() as client:
        body = {"url": added.url, "name": "extra", "kind": "openai"}
        r = await client.post(a.control_url + "/admin/pools/p/replicas", json=body, headers=AUTH)
        assert r.status_code == 201, r.text
        await wait_until(lambda: "extra" in pool_b.replicas, timeout=LOADED, what="B to add the replica")
        assert pool_b.replicas["extra"].url == added.url and pool_b.replicas["extra"].kind == "openai"
        # B routes to it: drain the original there, and its requests reach the added engine.
        r = await client.post(b.control_url + "/admin/pools/p/replicas/r0/drain", headers=AUTH)
        assert r.status_code == 200
        assert (await complete(client, b, "x")).headers["x-kvgate-replica"] == "extra"
        assert len(added.state.seen) == 1
        # A late instance adopts the fleet's replicas, not only its file's.
        late = await gateway(shared_settings([first.url], key_prefix))
        pool_late = late.runtime.pools["p"]
        await wait_until(lambda: "extra" in pool_late.replicas, timeout=LOADED, what="the late instance")
        r = await client.delete(b.control_url + "/admin/pools/p/replicas/extra", headers=AUTH)
        assert r.status_code == 200
        pool_a = a.runtime.pools["p"]
        await wait_until(
            lambda: "extra" not in pool_a.replicas and "extra" not in pool_late.replicas,
            timeout=LOADED,
            what="A and the late instance to remove it",
        )


def test_shared_state_wraps_approximate_indexes_and_leaves_precise_ones_to_kv_events(key_prefix) -> None:
    pools = [
        {"name": "approx", "model": "a", "endpoints": [{"url": "http://127.0.0.1:9"}]},
        {
            "name": "precise",
            "model": "b",
            "prefix": {"mode": "precise"},
            "endpoints": [{"url": "http://127.0.0.1:9", "kv_events": "tcp://127.0.0.1:9"}],
        },
    ]
    settings = load_config(None, {"pools": pools, "state": {"backend": "redis", "key_prefix": key_prefix}})
    runtime = Runtime(settings)
    approx, precise = runtime.routers["approx"], runtime.routers["precise"]
    assert isinstance(approx.match.index, SharedPrefixIndex)
    assert approx.match.index.prefix_closed  # the fast match survives the wrapping
    assert precise.precise is not None and precise.match.index is precise.precise.index


async def test_fleet_token_buckets_are_exact_and_all_or_nothing(key_prefix, upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    a = await gateway(shared_settings([up.url], key_prefix))
    b = await gateway(shared_settings([up.url], key_prefix))
    # 10 units, refilled so slowly that nothing comes back during the test.
    one = [Bucket("t1:requests", 1, 0.001, 10)]
    waits = await asyncio.gather(*(gw.runtime.state.take(one) for _ in range(15) for gw in (a, b)))
    assert sum(w == [0.0] for w in waits) == 10
    assert all(w[0] > 900 for w in waits if w != [0.0])  # about 1000 s until one unit is back
    # Several buckets: a charge one of them refuses is charged to none.
    both = [Bucket("t2:requests", 1, 0.001, 100), Bucket("t2:tokens", 40, 0.001, 50)]
    assert await a.runtime.state.take(both) == [0.0, 0.0]
    refused = await b.runtime.state.take(both)
    assert refused[0] == 0.0 and refused[1] > 0
    assert await b.runtime.state.take([Bucket("t2:requests", 99, 0.001, 100)]) == [0.0]  # 1 + 99 = 100
    # An oversized charge passes on a full bucket (and drives it negative), as gateway.admission.limits does.
    assert await a.runtime.state.take([Bucket("t3:tokens", 500, 1.0, 100)]) == [0.0]
    assert (await b.runtime.state.take([Bucket("t3:tokens", 1, 1.0, 100)]))[0] > 300


async def test_tenant_rate_limits_hold_across_gateways(key_prefix, upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    # One request per 100 s: the first gateway's request spends the tenant's whole allowance.
    tenants = [{"name": "acme", "api_key": "sk-acme", "requests_per_s": 0.01}]
    a = await gateway(shared_settings([up.url], key_prefix, tenants=tenants))
    b = await gateway(shared_settings([up.url], key_prefix, tenants=tenants))
    tenant = {"authorization": "Bearer sk-acme"}
    async with httpx.AsyncClient() as client:
        await complete(client, a, "hello", **tenant)
        r = await client.post(
            b.url + "/v1/completions", json={"model": "m", "prompt": "hello"}, headers=tenant
        )
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_requests"
    assert int(r.headers["retry-after"]) > 90
    assert len(up.state.seen) == 1


def _start_redis(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def own_redis() -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    procs = [_start_redis(port)]
    yield port, procs
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


async def _wait_ping(port: int) -> None:
    client = aioredis.Redis(host="127.0.0.1", port=port)

    async def pong() -> bool:
        try:
            return bool(await client.ping())
        except redis.RedisError:
            return False

    try:
        await wait_until(pong, 10, "redis-server", 0.02)
    finally:
        await client.aclose()


async def test_redis_outage_serves_locally_and_resynchronizes(upstreams, gateway, own_redis) -> None:
    from tests.routing.test_rollout import rollout_settings

    port, procs = own_redis
    await _wait_ping(port)
    s, c = await upstreams(2)
    state = {
        "backend": "redis",
        "redis_url": f"redis://127.0.0.1:{port}/0",
        "key_prefix": "outage",
        "sync_interval_s": 0.05,
    }
    a, b = [
        await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}, state=state))
        for _ in "ab"
    ]
    await wait_until(lambda: a.runtime.state.connected and b.runtime.state.connected, what="both connected")

    async with httpx.AsyncClient(timeout=10) as client:

        async def ask(gw: RunningGateway, text: str) -> httpx.Response:
            body = {"model": "llama", "prompt": text}
            r = await client.post(
                gw.url + "/v1/completions", json=body, headers={"x-canary": "0", "x-user-id": "u1"}
            )
            assert r.status_code == 200, r.text
            return r

        pool_of_u1 = (await ask(a, prompt(1))).headers["x-kvgate-pool"]
        procs[0].terminate()
        procs[0].wait(timeout=10)
        await wait_until(
            lambda: not a.runtime.state.connected and not b.runtime.state.connected, what="outage"
        )
        # Requests are still served from local state; admin changes apply locally meanwhile.
        for gw in (a, b):
            for i in range(3):
                await ask(gw, prompt(10 + i))
        r = await client.put(
            a.control_url + "/admin/routes/llama/weights", json={"weights": {"stable": 0}}, headers=AUTH
        )
        assert r.status_code == 200
        assert (await ask(a, prompt(2))).headers["x-kvgate-pool"] == "canary"
        assert (await ask(b, prompt(2))).headers["x-kvgate-pool"] == pool_of_u1  # B cannot know yet
        # Rate limits fall back to local buckets.
        assert await a.runtime.state.take([Bucket("k", 1, 1.0, 1)]) == [0.0]
        assert (await a.runtime.state.take([Bucket("k", 1, 1.0, 1)]))[0] > 0
        status = (await client.get(a.control_url + "/admin/state", headers=AUTH)).json()
        assert status["connected"] is False and status["last_error"]

        learned_on_a = set(a.runtime.routers["canary"].match.index.snapshot("canary-0"))
        procs.append(_start_redis(port))  # an empty Redis: everything must be pushed again
        await wait_until(
            lambda: a.runtime.state.connected and b.runtime.state.connected, timeout=10, what="reconnect"
        )
        await wait_until(
            lambda: b.runtime.rollouts.weights("llama") == {"stable": 0.0, "canary": 50.0},
            timeout=LOADED,
            what="A's outage-time weight change to reach B",
        )
        await wait_until(
            lambda: learned_on_a <= set(b.runtime.routers["canary"].match.index.snapshot("canary-0")),
            timeout=LOADED,
            what="A's prefix index to be republished to B",
        )
        assert (await ask(b, prompt(3))).headers["x-kvgate-pool"] == "canary"
        assert a.runtime.state.status()["resyncs"] == 1


def test_outbox_dedupe_keeps_the_index_identical() -> None:
    rng = random.Random(7)
    prompts: list[list[int]] = []
    for _ in range(200):
        head = rng.choice([[1, 2, 3], [1, 2, 4], [9], []])
        prompts.append(head + [rng.randrange(10, 60) for _ in range(rng.randrange(0, 4))])
    full, deduped = PrefixIndex(default_capacity=30), PrefixIndex(default_capacity=30)
    for p in prompts:
        full.merge("r", p[::-1])
    for p in dedupe(prompts):
        deduped.merge("r", list(p)[::-1])
    assert deduped.snapshot("r") == full.snapshot("r")
    assert sum(map(len, dedupe(prompts))) < sum(map(len, prompts)) / 2


async def test_redis_down_at_start_then_up(upstreams, gateway) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    (up,) = await upstreams(1)
    a = await gateway(shared_settings([up.url], "late", redis_url=f"redis://127.0.0.1:{port}/0"))
    assert not a.runtime.state.connected
    async with httpx.AsyncClient() as client:
        await complete(client, a, prompt(1))  # served from local state
    server = _start_redis(port)
    try:
        await _wait_ping(port)
        b = await gateway(shared_settings([up.url], "late", redis_url=f"redis://127.0.0.1:{port}/0"))
        await wait_until(lambda: a.runtime.state.connected, timeout=5, what="A to connect")
        await wait_until(lambda: blocks(b) == blocks(a) > 0, timeout=5, what="B to learn what A knew")
    finally:
        server.terminate()
        server.wait(timeout=10)
