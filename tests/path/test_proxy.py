"""The gateway core end to end: real upstream servers, a real gateway, real clients."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import orjson
import pytest

from gateway.config import load_config
from gateway.fleet.breaker import BreakerState
from tests.conftest import free_port, gateway_settings, wait_until


async def test_openai_sdk_chat_and_completions_stream_and_not(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "hello from u0"
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert pieces == [f"tok{i} " for i in range(5)]
    comp = await client.completions.create(model="m", prompt="once upon")
    assert comp.choices[0].text == "hello from u0"
    cstream = await client.completions.create(model="m", prompt="once upon", stream=True)
    assert [c.choices[0].text async for c in cstream] == [f"tok{i} " for i in range(5)]
    assert [s.path for s in up.state.seen] == [
        "/v1/chat/completions",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/completions",
    ]


async def test_body_forwarded_byte_for_byte_with_unknown_fields(upstreams, gateway):
    (up,) = await upstreams(1)
    # Engines that schedule by priority: the client's integer `priority` is theirs, kept as sent.
    gw = await gateway(gateway_settings([up.url], pool={"priority_scheduling": True}))
    raw = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "u-7", "priority": -3,'
        b' "cache_salt": "s1", "vendor_extension": {"deep": null, "kv": [1, 2]}}'
    )
    async with httpx.AsyncClient() as c:
        r = await c.post(
            gw.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert r.status_code == 200
    assert up.state.seen[0].raw == raw


async def test_request_id_echoed_to_the_client_engines_get_the_gateways_own(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    body = {"model": "m", "prompt": "p"}
    async with httpx.AsyncClient() as c:
        r1 = await c.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "abc-123"})
        r2 = await c.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "abc-123"})
        r3 = await c.post(gw.url + "/v1/completions", json=body)
        # An id unfit for logs (control characters, or too long) is not used at all.
        r4 = await c.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "x" * 200})
    assert r1.headers["x-request-id"] == r2.headers["x-request-id"] == "abc-123"
    engine_ids = [s.headers.getall("X-Request-Id") for s in up.state.seen]
    assert all(len(ids) == 1 and len(ids[0]) == 32 for ids in engine_ids)
    # Two requests with one client id are still two requests to the engine.
    assert len({ids[0] for ids in engine_ids}) == 4
    assert r3.headers["x-request-id"] == engine_ids[2][0]
    assert r4.headers["x-request-id"] == engine_ids[3][0]
    assert r1.headers["x-kvgate-replica"] == "r0" and r1.headers["x-kvgate-pool"] == "p"


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return err


async def test_client_errors_in_openai_form(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], server={"max_body_bytes": 1000}))
    url = gw.url + "/v1/chat/completions"
    async with httpx.AsyncClient() as c:
        _assert_openai_error(await c.post(url, content=b"{not json"), 400, "invalid_json")
        _assert_openai_error(await c.post(url, content=b"[1, 2]"), 400, "invalid_json")
        _assert_openai_error(await c.post(url, content=b""), 400, "invalid_json")
        err = _assert_openai_error(await c.post(url, json={"messages": []}), 400, "missing_model")
        assert err["param"] == "model"
        _assert_openai_error(await c.post(url, json={"model": 5}), 400, "invalid_model")
        _assert_openai_error(await c.post(url, json={"model": "nope"}), 404, "model_not_found")
        big = {"model": "m", "prompt": "x" * 2000}
        _assert_openai_error(await c.post(url, json=big), 413, "request_too_large")
        _assert_openai_error(await c.get(gw.url + "/v1/unknown"), 404, "not_found")
        _assert_openai_error(await c.get(url), 405, "method_not_allowed")
        # and the gateway keeps serving
        ok = await c.post(url, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
    assert len(up.state.seen) == 1


async def test_upstream_errors_relayed_and_sglang_form_normalized(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    body = {"model": "m", "prompt": "p"}
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json=body, headers={"x-test-mode": "status:400"})
        err = _assert_openai_error(r, 400)
        assert err["message"] == "u0 says 400"
        r = await c.post(gw.url + "/v1/completions", json=body, headers={"x-test-mode": "sglang-error"})
        err = _assert_openai_error(r, 400)
        assert err["message"] == "bad sampling params" and err["type"] == "invalid_request_error"
        assert err["code"] == "bad_request"


async def test_retry_on_503_goes_to_next_replica(upstreams, gateway):
    bad, good = await upstreams(2)
    bad.state.force_status = 503
    gw = await gateway(gateway_settings([bad.url, good.url]))
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p"})
    assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "r1"
    assert len(bad.state.seen) == 1 and len(good.state.seen) == 1


async def test_when_every_try_is_refused_the_last_answer_is_relayed(upstreams, gateway):
    a, b = await upstreams(2)
    a.state.force_status = b.state.force_status = 503
    gw = await gateway(gateway_settings([a.url, b.url]))
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p"})
    err = _assert_openai_error(r, 503)
    assert err["message"].endswith("says 503")
    assert len(a.state.seen) + len(b.state.seen) == 3  # max_attempts = 3, wrapping around the ranking


async def test_no_retry_after_a_client_error(upstreams, gateway):
    a, b = await upstreams(2)
    a.state.force_status = 400
    gw = await gateway(gateway_settings([a.url, b.url]))
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p"})
    _assert_openai_error(r, 400)
    assert len(a.state.seen) == 1 and not b.state.seen


async def test_retry_on_connect_error_reaches_live_replica(upstreams, gateway):
    (good,) = await upstreams(1)
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway(gateway_settings([dead, good.url], health={"enabled": False}))
    async with httpx.AsyncClient() as c:
        for _ in range(4):
            r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p"})
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "r1"
    assert len(good.state.seen) == 4


async def test_circuit_opens_after_consecutive_failures(upstreams, gateway):
    (good,) = await upstreams(1)
    dead = f"http://127.0.0.1:{free_port()}"
    settings = gateway_settings(
        [dead, good.url], health={"enabled": False}, breaker={"failure_threshold": 2, "open_s": 60}
    )
    gw = await gateway(settings)
    async with httpx.AsyncClient() as c:
        for _ in range(6):
            assert (
                await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p"})
            ).status_code == 200
    dead_replica = gw.runtime.pools["p"].replicas["r0"]
    assert dead_replica.breaker.state is BreakerState.OPEN
    assert not dead_replica.available


async def test_no_healthy_replica_is_503_with_retry_after(gateway):
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway(gateway_settings([dead]))
    pool = gw.runtime.pools["p"]
    await wait_until(lambda: not pool.replicas["r0"].healthy, what="health check to eject r0")
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p"})
        ready = await c.get(gw.url + "/ready")
    _assert_openai_error(r, 503, "no_healthy_replica")
    assert int(r.headers["retry-after"]) >= 1
    assert ready.status_code == 503 and ready.json()["pools"] == {"p": False}


async def test_health_checks_eject_and_readmit(upstreams, gateway):
    a, b = await upstreams(2)
    gw = await gateway(gateway_settings([a.url, b.url]))
    replica = gw.runtime.pools["p"].replicas["r0"]

    a.state.healthy = False
    await wait_until(lambda: not replica.healthy, what="ejection")
    async with httpx.AsyncClient() as c:
        served = {
            (await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p"})).headers[
                "x-kvgate-replica"
            ]
            for _ in range(4)
        }
    assert served == {"r1"}
    a.state.healthy = True
    await wait_until(lambda: replica.healthy, what="readmission")


async def test_mid_stream_failure_ends_with_sse_error_event(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body, headers={"x-test-mode": "midstream:2"})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) == 3 and b"[DONE]" not in r.content
    last = orjson.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == "upstream_stream_error"


async def test_client_disconnect_cancels_upstream_and_releases_load(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    replica = gw.runtime.pools["p"].replicas["r0"]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with httpx.AsyncClient() as c:
        async with c.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers={"x-test-mode": "hang-stream"}
        ) as r:
            async for _ in r.aiter_bytes():
                break  # first chunk arrived; now go away
            assert replica.inflight_requests == 1
        left = time.monotonic()
    await asyncio.wait_for(up.state.disconnected.wait(), timeout=1.0)
    assert up.state.disconnects[0] - left < 1.0
    await wait_until(lambda: replica.inflight_requests == 0, timeout=1, what="load release")
    assert replica.inflight_requests == 0 and replica.inflight_tokens == 0


async def test_first_byte_timeout_is_504(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], upstream={"first_byte_timeout_s": 0.2}))
    async with httpx.AsyncClient() as c:
        r = await c.post(
            gw.url + "/v1/completions", json={"model": "m", "prompt": "p"}, headers={"x-test-mode": "stall:2"}
        )
    _assert_openai_error(r, 504, "upstream_timeout")
    assert gw.runtime.pools["p"].replicas["r0"].inflight_requests == 0


async def test_api_keys_and_admin_key_are_separate(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(
        gateway_settings([up.url], server={"api_keys": ["k-client"]}, control={"admin_key": "k-admin"})
    )
    body = {"model": "m", "prompt": "p"}
    async with httpx.AsyncClient() as c:
        _assert_openai_error(await c.post(gw.url + "/v1/completions", json=body), 401, "missing_api_key")
        bad = {"authorization": "Bearer k-admin"}
        _assert_openai_error(
            await c.post(gw.url + "/v1/completions", json=body, headers=bad), 401, "invalid_api_key"
        )
        ok = await c.post(gw.url + "/v1/completions", json=body, headers={"authorization": "Bearer k-client"})
        assert ok.status_code == 200
        models = await c.get(gw.url + "/v1/models", headers={"authorization": "Bearer k-client"})
        assert [m["id"] for m in models.json()["data"]] == ["m"]
    # the client's key is the gateway's business, not the engine's
    assert "Authorization" not in up.state.seen[0].headers and "authorization" not in up.state.seen[0].headers


@pytest.mark.parametrize("stream", [False, True])
async def test_load_released_after_every_outcome(upstreams, gateway, stream):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], upstream={"first_byte_timeout_s": 0.3}))
    body = {"model": "m", "prompt": "p", "stream": stream}
    async with httpx.AsyncClient() as c:
        for mode in ["", "status:500", "status:503", "status:400", "stall:1", "midstream:1"]:
            await c.post(gw.url + "/v1/completions", json=body, headers={"x-test-mode": mode})
    replica = gw.runtime.pools["p"].replicas["r0"]
    assert replica.inflight_requests == 0 and replica.inflight_tokens == 0


async def test_observers_receive_one_record_per_request(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    records = []
    gw.runtime.observers.append(records.append)
    async with httpx.AsyncClient() as c:
        await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "p", "stream": True})
        await c.post(gw.url + "/v1/completions", json={"model": "zzz", "prompt": "p"})
    ok, missing = records
    assert (ok.status, ok.pool, ok.replica, ok.stream, ok.endpoint) == (200, "p", "r0", True, "completions")
    assert ok.ttft_s is not None and 0 < ok.ttft_s <= ok.duration_s
    assert (missing.status, missing.error_code, missing.replica) == (404, "model_not_found", None)


async def test_readiness_is_per_pool_and_liveness_outlasts_the_drain(upstreams, gateway):
    """One pool without a healthy replica (a dead canary) leaves the gateway ready by default;
    `/ready/{model}` answers for one model or route, `server.ready` can demand all or named
    pools, and `/live` answers 200 even while the gateway drains."""
    (up,) = await upstreams(1)
    canary = {
        "name": "canary",
        "model": "org/canary",
        "endpoints": [{"url": f"http://127.0.0.1:{free_port()}"}],
    }
    split = [{"pools": [{"name": "p", "weight": 90}, {"name": "canary", "weight": 10}]}]
    only_canary = [{"pools": [{"name": "canary", "weight": 100}]}]
    routes = [{"model": "llama", "rules": split}, {"model": "beta", "rules": only_canary}]
    paths = ("/ready", "/ready/m", "/ready/org/canary", "/ready/llama", "/ready/beta", "/ready/nope", "/live")

    async def probe(rule: object, drain: bool = False) -> dict[str, int]:
        main = {"name": "p", "model": "m", "endpoints": [{"url": up.url}]}
        settings = load_config(
            None,
            {
                "server": {"port": 0, "ready": rule, "grace_period_s": 1},
                "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1},
                "pools": [main, canary],
                "routes": routes,
            },
        )
        gw = await gateway(settings)
        await wait_until(lambda: not gw.runtime.pools["canary"].has_healthy(), what="the canary's ejection")
        gw.runtime.draining = drain
        async with httpx.AsyncClient() as c:
            return {path: (await c.get(gw.url + path)).status_code for path in paths}

    assert await probe("any") == {
        "/ready": 200,
        "/ready/m": 200,
        "/ready/org/canary": 503,
        "/ready/llama": 200,  # one of its pools can serve
        "/ready/beta": 503,
        "/ready/nope": 404,
        "/live": 200,
    }
    assert (await probe("all"))["/ready"] == 503
    assert (await probe(["p"]))["/ready"] == 200
    assert (await probe(["canary", "p"]))["/ready"] == 503
    draining = await probe("any", drain=True)
    assert draining["/ready"] == draining["/ready/m"] == 503 and draining["/live"] == 200
