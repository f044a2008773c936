"""Prefill/decode disaggregation end to end: a real gateway in front of simulator processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import openai
import pytest

from gateway.fleet.breaker import Admission, BreakerState
from gateway.path.handoff import PREFILL_LOST
from tests.conftest import gateway_settings, wait_until
from tests.hostile_upstream import HostileUpstream
from tests.simfleet import seen, sim_fleet, sim_process

LONG = "Summarize the following text. " + "The quick brown fox jumps over the lazy dog. " * 80
PRODUCER = ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}))
CONSUMER = ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}))
# What a client could send to make a decode engine pull KV from a host of its choosing.
EVIL_KV = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1, "remote_block_ids": [1]}


def pd_settings(
    prefill: str, decode: str, kind: str = "vllm", side_channel: str | None = None, **pool: object
):
    endpoints = [
        {
            "url": prefill,
            "name": "prefill-0",
            "role": "prefill",
            "kind": kind,
            "kv_side_channel_host": side_channel,
        },
        {"url": decode, "name": "decode-0", "role": "decode", "kind": kind},
    ]
    return gateway_settings([], pool={"endpoints": endpoints, "pd": {"min_uncached_tokens": 64}, **pool})


async def test_vllm_relay_carries_prefill_kv_params_verbatim_and_keeps_streaming(gateway):
    with sim_process(*PRODUCER) as prefill, sim_process(*CONSUMER) as decode:
        gw = await gateway(pd_settings(prefill, decode))
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": LONG}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            # A client's own transfer target is never an engine's: the gateway's replaces it.
            extra_body={"kv_transfer_params": EVIL_KV, "bootstrap_host": "10.9.9.9"},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        (p_leg,) = await seen(prefill)
        (d_leg,) = await seen(decode)
    body = p_leg["body"]
    assert body["stream"] is False and body["max_tokens"] == 1 and "stream_options" not in body
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    # The decode leg: the client's own body (streaming, its max_tokens) plus the prefill's answer.
    ktp = d_leg["kv_transfer_params"]
    assert d_leg["body"]["stream"] is True and d_leg["body"]["max_tokens"] == 8
    assert ktp["do_remote_prefill"] is True and ktp["remote_block_ids"]
    assert ktp["remote_port"] == int(prefill.rsplit(":", 1)[1]) and ktp["remote_host"] != "10.9.9.9"
    assert p_leg["kv_transfer_params"]["remote_host"] is None
    assert "bootstrap_host" not in d_leg["body"] and "bootstrap_host" not in p_leg["body"]
    assert p_leg["headers"]["x-request-id"] == d_leg["headers"]["x-request-id"]


async def test_short_prompt_is_not_disaggregated(gateway):
    with sim_process(*PRODUCER) as prefill, sim_process(*CONSUMER) as decode:
        gw = await gateway(pd_settings(prefill, decode))
        async with httpx.AsyncClient() as c:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": EVIL_KV}
            r = await c.post(gw.url + "/v1/completions", json=body)
        assert r.status_code == 200
        assert await seen(prefill) == []
        (d_leg,) = await seen(decode)
    assert d_leg["kv_transfer_params"] is None  # the client's was removed, and no hand-off happened


async def test_prefill_5xx_falls_back_to_decode_only(gateway):
    failing = ("--fault-error-rate", "1", "--fault-error-status", "500")
    with sim_process(*PRODUCER, *failing) as prefill, sim_process(*CONSUMER) as decode:
        gw = await gateway(pd_settings(prefill, decode))
        async with httpx.AsyncClient() as c:
            r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "decode-0"
        (d_leg,) = await seen(decode)
    assert d_leg["kv_transfer_params"] is None  # the decode replica prefilled by itself


async def test_prefill_4xx_is_passed_to_the_client(gateway):
    refusing = ("--fault-error-rate", "1", "--fault-error-status", "400")
    with sim_process(*PRODUCER, *refusing) as prefill, sim_process(*CONSUMER) as decode:
        gw = await gateway(pd_settings(prefill, decode))
        async with httpx.AsyncClient() as c:
            r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert await seen(decode) == []


async def test_sglang_legs_share_one_bootstrap_room(gateway):
    from tests.conftest import free_port

    boot = free_port()
    sglang = ("--api", "sglang")
    with (
        sim_process(
            *sglang, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)
        ) as prefill,
        sim_process(*sglang, "--disaggregation-mode", "decode") as decode,
    ):
        settings = pd_settings(prefill, decode, kind="sglang")
        settings.pools[0].endpoints[0].bootstrap_port = boot
        gw = await gateway(settings)
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        (p_leg,) = await seen(prefill)
        (d_leg,) = await seen(decode)
    assert p_leg["bootstrap"] == d_leg["bootstrap"]
    assert d_leg["bootstrap"]["bootstrap_port"] == boot and 0 <= d_leg["bootstrap"]["bootstrap_room"] < 2**63
    assert p_leg["body"] == d_leg["body"]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_abandoned_request_settles_the_prefill_legs_probe_and_load(gateway, kind: str):
    """A client that leaves while the prefill leg is in flight (sequential vLLM relay, or SGLang's
    concurrent leg) must not leave the prefill replica's half-open probe or load claimed."""
    from tests.conftest import free_port

    # Long enough to outlast the client (1 s), short enough not to hold up the simulator's shutdown.
    stall = ("--fault-stall-rate", "1", "--fault-stall-s", "4")
    if kind == "vllm":
        prefill_args, decode_args = (*PRODUCER, *stall), CONSUMER
    else:
        boot = free_port()
        prefill_args = (
            "--api",
            "sglang",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(boot),
            *stall,
        )
        decode_args = ("--api", "sglang", "--disaggregation-mode", "decode")
    with sim_process(*prefill_args) as prefill_url, sim_process(*decode_args) as decode_url:
        settings = pd_settings(prefill_url, decode_url, kind=kind)
        settings.breaker.failure_threshold, settings.breaker.open_s = 1, 0.05
        if kind == "sglang":
            settings.pools[0].endpoints[0].bootstrap_port = boot
        gw = await gateway(settings)
        pool = gw.runtime.pools["p"]
        prefill, decode = pool.replicas["prefill-0"], pool.replicas["decode-0"]
        prefill.breaker.record_failure(Admission.ADMITTED)  # open: the next request is the probe
        await wait_until(prefill.breaker.allows, what="the prefill replica's circuit to half-open")
        body = {"model": "m", "prompt": LONG, "max_tokens": 2}
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(gw.url + "/v1/completions", json=body, timeout=1.0)
        assert prefill.breaker.state is BreakerState.HALF_OPEN
        await wait_until(
            lambda: (
                not prefill.breaker.probe_in_flight
                and prefill.inflight_requests == decode.inflight_requests == 0
            ),
            what="the prefill probe and both legs' load released",
        )
        assert prefill.inflight_tokens == decode.inflight_tokens == 0


async def test_sglang_prefill_leg_that_cannot_connect_fails_the_request_fast(gateway):
    """The decode leg (an engine that would wait forever for its bootstrap partner) is dropped
    as soon as the concurrent prefill leg fails, and only the prefill replica is blamed."""
    from tests.conftest import free_port

    decode_engine = await HostileUpstream("stall-head").start()
    try:
        settings = pd_settings(f"http://127.0.0.1:{free_port()}", decode_engine.url, kind="sglang")
        settings.health.enabled = False  # the leg itself must find the prefill replica gone
        settings.pools[0].endpoints[0].bootstrap_port = free_port()
        gw = await gateway(settings)
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_prefill_failed"
        pool = gw.runtime.pools["p"]
        prefill, decode = pool.replicas["prefill-0"], pool.replicas["decode-0"]
        assert prefill.breaker.consecutive_failures == 1  # its transport failure, not the decode replica's
        assert decode.breaker.consecutive_failures == 0 and len(decode_engine.deliveries) <= 1
        await wait_until(
            lambda: prefill.inflight_requests == decode.inflight_requests == 0, what="load released"
        )
    finally:
        await decode_engine.stop()


def _consumer(policy: str) -> tuple[str, str]:
    transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": policy}
    return ("--kv-transfer-config", json.dumps(transfer))


# The prefill replica advertises a side channel where nothing listens, as one that died right after
# answering would: the decode replica's KV load fails.
# The prefill engine names 127.0.0.2 for its KV (as its operator says its side channel is there,
# `kv_side_channel_host`), where nothing listens: it is gone once it answered.
GONE_AFTER_ANSWERING = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.2"}
GONE_HOST = "127.0.0.2"


async def test_decode_that_cannot_load_the_kv_is_retried_without_the_hand_off(gateway):
    with (
        sim_process(*PRODUCER, env=GONE_AFTER_ANSWERING) as prefill,
        sim_process(*_consumer("fail")) as decode,
    ):
        gw = await gateway(pd_settings(prefill, decode, side_channel=GONE_HOST))
        async with httpx.AsyncClient() as c:
            r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        legs = await seen(decode)
    assert [leg["kv_transfer_params"] is not None for leg in legs] == [True, False]


async def test_decode_with_recompute_policy_prefills_a_lost_kv_itself(gateway):
    with (
        sim_process(*PRODUCER, env=GONE_AFTER_ANSWERING) as prefill,
        sim_process(*_consumer("recompute")) as decode,
    ):
        gw = await gateway(pd_settings(prefill, decode, side_channel=GONE_HOST))
        async with httpx.AsyncClient() as c:
            body = {"model": "m", "prompt": LONG, "max_tokens": 4, "stream": True}
            async with c.stream("POST", gw.url + "/v1/completions", json=body) as r:
                text = (await r.aread()).decode()
        assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in text
        (leg,) = await seen(decode)
    assert leg["kv_transfer_params"]["remote_request_id"]  # one try, the hand-off's: recomputed there


async def test_streamed_decode_that_cannot_load_the_kv_is_served_whole_by_it(gateway):
    # vLLM (kv_load_failure_policy: fail) begins the stream, then ends it with an error event
    # before any text. The decode replica is not at fault: it serves the request again, whole,
    # without the hand-off, and the client gets one uninterrupted answer.
    with (
        sim_process(*PRODUCER, env=GONE_AFTER_ANSWERING) as prefill,
        sim_process(*_consumer("fail")) as decode,
    ):
        gw = await gateway(pd_settings(prefill, decode, side_channel=GONE_HOST))
        async with httpx.AsyncClient() as c:
            body = {"model": "m", "prompt": LONG, "max_tokens": 4, "stream": True}
            async with c.stream("POST", gw.url + "/v1/completions", json=body) as r:
                text = (await r.aread()).decode()
        legs = await seen(decode)
    assert r.status_code == 200
    events = [e for e in text.split("\n\n") if e.strip()]
    assert '"error"' not in text and events[-1] == "data: [DONE]"
    assert len([e for e in events if '"text"' in e]) == 4
    assert [leg["kv_transfer_params"] is not None for leg in legs] == [True, False]


@pytest.mark.parametrize("failover", [True, False], ids=["failover", "no-failover"])
async def test_a_decode_leg_waiting_on_a_hung_prefill_replica_is_not_left_waiting(gateway, failover):
    """On the H200 a stopped vLLM prefill replica held the decode leg's KV fetch until the client
    gave up. Here the prefill answers its legs, hangs once the decode asks for the KV (the
    `lease_stall` fault), and is stopped: its health checks eject it, the decode legs are dropped,
    and the decode replica serves the requests whole, an answer and a stream (a stream without
    failover cannot be: its client is told)."""
    with sim_fleet(*PRODUCER) as prefill, sim_process(*CONSUMER) as decode:
        pool = {"client_passthrough": {"headers": ["x-sim-fault"]}, "failover": {"mid_stream": failover}}
        gw = await gateway(pd_settings(prefill.url, decode, **pool))
        streams = [False, True] if failover else [True]
        async with httpx.AsyncClient(timeout=120) as c:

            async def ask(stream: bool) -> httpx.Response:
                body = {"model": "m", "prompt": f"{stream} {LONG}", "max_tokens": 4, "stream": stream}
                headers = {"x-sim-fault": "lease_stall=600"}
                return await c.post(gw.url + "/v1/completions", json=body, headers=headers)

            answers = [asyncio.create_task(ask(stream)) for stream in streams]
            try:

                async def decode_legs_sent() -> bool:
                    legs = await seen(decode)
                    return sum(bool(leg["kv_transfer_params"]) for leg in legs) == len(streams)

                await wait_until(
                    decode_legs_sent, timeout=30, what="the decode legs, their KV fetches hanging"
                )
                os.kill(prefill.proc.pid, signal.SIGSTOP)
                replies = await asyncio.gather(*answers)
            finally:
                os.kill(prefill.proc.pid, signal.SIGCONT)
                for answer in answers:
                    answer.cancel()
        legs = await seen(decode)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    if not failover:
        (r,) = replies
        assert json.loads(r.text.split("\n\n")[0].removeprefix("data: "))["error"]["message"] == PREFILL_LOST
        assert [leg["kv_transfer_params"] is not None for leg in legs] == [True]
        return
    answer, stream = replies
    assert answer.json()["usage"]["completion_tokens"] == 4
    assert '"error"' not in stream.text and stream.text.rstrip().endswith("data: [DONE]")
    # Each request: its hand-off's decode leg, then the decode replica serving it whole.
    assert sorted(leg["kv_transfer_params"] is not None for leg in legs) == [False, False, True, True]


async def test_hand_offs_past_the_transfer_bound_are_served_whole_until_the_bound_frees(gateway):
    """`pd.max_transfer_tokens`: while one hand-off's KV is in transfer (its decode leg has not
    begun to answer), another request is served whole by the decode replica; once that hand-off
    is given up (its client left), the bound is free again."""
    with sim_process(*PRODUCER) as prefill, sim_process(*CONSUMER) as decode:
        pd = {"min_uncached_tokens": 64, "max_transfer_tokens": 1}
        gw = await gateway(
            pd_settings(prefill, decode, pd=pd, client_passthrough={"headers": ["x-sim-fault"]})
        )
        pool = gw.runtime.fleet.pools["p"]
        async with httpx.AsyncClient(timeout=60) as c:

            async def ask(prompt: str, **headers: str) -> httpx.Response:
                body = {"model": "m", "prompt": prompt, "max_tokens": 2}
                return await c.post(gw.url + "/v1/completions", json=body, headers=headers)

            held = asyncio.create_task(ask(LONG, **{"x-sim-fault": "lease_stall=600"}))
            try:

                async def in_transfer() -> bool:
                    return any(leg["kv_transfer_params"] for leg in await seen(decode))

                await wait_until(
                    in_transfer, timeout=30, what="the first hand-off's decode leg, its KV fetch held"
                )
                assert pool.transfer_tokens > 0
                whole = await ask("Another document. " + LONG)
                assert whole.status_code == 200, whole.text
            finally:
                held.cancel()
            await wait_until(
                lambda: pool.transfer_tokens == 0, timeout=30, what="the given-up hand-off to leave the bound"
            )
            after = await ask("A third document. " + LONG)
            assert after.status_code == 200, after.text
            metrics = (await c.get(gw.url + "/metrics")).text
        prefill_legs = await seen(prefill)
        decode_legs = await seen(decode)
    assert [leg["kv_transfer_params"] is not None for leg in decode_legs] == [True, False, True]
    assert len(prefill_legs) == 2  # the first and the third: the second was never handed off
    assert 'kvgate_pd_requests_total{path="link_full",pool="p"} 1.0' in metrics


@pytest.mark.parametrize("advertised", [None, "10.9.9.9"], ids=["its-own-host", "another-host"])
async def test_a_prefill_answer_naming_another_host_for_its_kv_is_not_relayed(gateway, advertised):
    """An engine's answer must not send another engine elsewhere: with the prefill endpoint's side
    channel known (`kv_side_channel_host`; the launcher sets it for engines it starts), a prefill
    answer naming another host for its KV goes no further, and the decode replica serves the
    request whole."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": advertised} if advertised else None
    with sim_process(*PRODUCER, env=env) as prefill, sim_process(*CONSUMER) as decode:
        endpoints = [
            {"url": prefill, "name": "prefill-0", "role": "prefill", "kv_side_channel_host": "127.0.0.1"},
            {"url": decode, "name": "decode-0", "role": "decode"},
        ]
        pool = {"endpoints": endpoints, "pd": {"min_uncached_tokens": 64}}
        gw = await gateway(gateway_settings([], pool=pool))
        async with httpx.AsyncClient() as c:
            r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
        (p_leg,) = await seen(prefill)
        (d_leg,) = await seen(decode)
    assert p_leg["body"]["kv_transfer_params"]["do_remote_decode"] is True
    if advertised:
        assert d_leg["kv_transfer_params"] is None
    else:
        assert d_leg["kv_transfer_params"]["remote_host"] == "127.0.0.1"


@pytest.mark.parametrize("mode", ["prefill-ok", "prefill-steer", "prefill-bad-port"])
async def test_a_prefill_endpoint_steers_the_decode_engine_only_to_its_own_host(mode: str, gateway) -> None:
    """Issue 35: with no kv_side_channel_host (an endpoint's default), a prefill engine's answer
    could send the decode engine to any host:port. Now only the prefill endpoint's own host (its
    URL's), on a port, is handed on; anything else is served whole by the decode replica."""
    prefill, decode = HostileUpstream(mode), HostileUpstream("ok")
    await prefill.start()
    await decode.start()
    try:
        endpoints = [
            {"url": prefill.url, "name": "prefill-0", "role": "prefill", "kind": "vllm"},
            {"url": decode.url, "name": "decode-0", "role": "decode", "kind": "vllm"},
        ]
        pool = {"endpoints": endpoints, "pd": {"min_uncached_tokens": 0}}
        gw = await gateway(gateway_settings([], pool=pool, health={"enabled": False}))
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(
                gw.url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2}
            )
        assert r.status_code == 200
        (leg,) = decode.deliveries
        handed = json.loads(leg.body).get("kv_transfer_params")
        if mode == "prefill-ok":
            assert handed["remote_host"] == "127.0.0.1" and handed["remote_port"] == 5600
        else:
            assert handed is None  # decode-only: the engine's word did not reach the other engine
    finally:
        await prefill.stop()
        await decode.stop()
