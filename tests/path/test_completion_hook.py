"""The policy's completion hook, end to end: a real gateway in front of simulator processes, a
policy plugin recording `on_complete`, which must fire exactly once per routed request however it
ends: an answer, an engine's error, a retry that went to another replica, a client that leaves
in the middle of a stream, and the prefill leg of a disaggregated request chosen by `select_pair`.
And `on_first_token`: once per streamed answer, before its completion, never for the others."""

from __future__ import annotations

import httpx

from gateway.server import RunningGateway
from tests.conftest import gateway_settings, wait_until
from tests.path.test_pd import CONSUMER, LONG, PRODUCER
from tests.recording_policy import ID_HEADER, Ended, Recording
from tests.simfleet import seen, sim_process

POLICY = {"type": "tests.recording_policy:Recording"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


def recorder(gw: RunningGateway) -> Recording:
    policy = gw.runtime.routers["p"].policy
    assert isinstance(policy, Recording)
    return policy


async def ended_once(policy: Recording, test_id: str) -> Ended:
    """The one completion of a request, once it came (a second would fail the next check)."""
    await wait_until(lambda: policy.of(test_id), what=f"on_complete for {test_id}")
    (ended,) = policy.of(test_id)
    return ended


async def test_fires_once_on_success_engine_error_and_a_retry_to_another_replica(gateway) -> None:
    refusing = ("--fault-error-rate", "1", "--fault-error-status", "503")
    with sim_process(*refusing) as busy, sim_process() as good:
        # r0 refuses everything (503, retried), r1 answers; the policy ranks r0 first unless pinned.
        settings = gateway_settings(
            [busy, good], pool={"policy": POLICY, "client_passthrough": {"headers": ["x-sim-fault"]}}
        )
        gw = await gateway(settings)
        policy = recorder(gw)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=CHAT, headers={ID_HEADER: "ok", "x-pin": "r1"})
            assert r.status_code == 200
            usage = r.json()["usage"]
            r = await c.post("/v1/chat/completions", json=CHAT, headers={ID_HEADER: "retried"})
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "r1"
            failing = {ID_HEADER: "engine-error", "x-pin": "r1", "x-sim-fault": "status=500"}
            r = await c.post("/v1/chat/completions", json=CHAT, headers=failing)
            assert r.status_code == 500
            stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            pinned = {ID_HEADER: "stream", "x-pin": "r1"}
            r = await c.post("/v1/chat/completions", json=stream, headers=pinned)
            assert r.status_code == 200 and "[DONE]" in r.text

        first = await ended_once(policy, "ok")
        ok = first.outcome
        assert first.replica == "r1" and ok.ok and ok.status == 200 and ok.error is None and ok.attempts == 1
        assert ok.ttft_s is not None and 0 < ok.ttft_s <= ok.e2e_s
        # The engine's own figures, from its usage.
        assert ok.prompt_tokens == usage["prompt_tokens"]
        assert ok.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]

        retried = await ended_once(policy, "retried")
        assert retried.replica == "r1" and retried.outcome.ok and retried.outcome.attempts == 2

        error = await ended_once(policy, "engine-error")
        assert error.replica == "r1" and not error.outcome.ok
        assert error.outcome.status == 500 and error.outcome.error == "engine_error"

        streamed = await ended_once(policy, "stream")
        assert streamed.outcome.ok and streamed.outcome.status == 200
        assert streamed.outcome.cached_tokens is not None and streamed.outcome.prompt_tokens > 0
        assert len(policy.ended) == 4
        # Only the streamed answer's first token is heard, from its replica, before it ended.
        assert policy.first_tokens == [("stream", "r1", False)]


async def test_fires_once_when_every_replica_refuses(gateway) -> None:
    refusing = ("--fault-error-rate", "1", "--fault-error-status", "503")
    with sim_process(*refusing) as a, sim_process(*refusing) as b:
        gw = await gateway(gateway_settings([a, b], pool={"policy": POLICY}))
        policy = recorder(gw)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=CHAT, headers={ID_HEADER: "refused"})
        assert r.status_code == 503
        ended = await ended_once(policy, "refused")
        # max_attempts (3) wraps around the two replicas: r0, r1, r0.
        assert ended.replica == "r0" and ended.outcome.attempts == 3
        assert ended.outcome.error == "engine_error" and ended.outcome.status == 503


async def test_fires_once_when_the_client_leaves_mid_stream(gateway) -> None:
    with sim_process(speedup=1.0) as url:
        gw = await gateway(gateway_settings([url], pool={"policy": POLICY}))
        policy = recorder(gw)
        body = {**CHAT, "max_tokens": 2000, "stream": True}
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=body, headers={ID_HEADER: "gone"}) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # one token in: leave, closing the connection
        gone = await ended_once(policy, "gone")
        assert gone.replica == "r0" and not gone.outcome.ok
        assert gone.outcome.error == "client_disconnected" and gone.outcome.ttft_s is not None
        # Another request ends after it: still a single call for the one that went away.
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=CHAT, headers={ID_HEADER: "after"})
            assert r.status_code == 200
        await ended_once(policy, "after")
        assert len(policy.of("gone")) == 1 and len(policy.ended) == 2
        assert policy.first_tokens == [("gone", "r0", False)]


async def test_select_pair_picks_the_prefill_leg_and_completion_names_it(gateway) -> None:
    with (
        sim_process(*PRODUCER) as p0,
        sim_process(*PRODUCER) as p1,
        sim_process(*CONSUMER) as decode,
    ):
        endpoints = [
            {"url": p0, "name": "prefill-0", "role": "prefill", "kind": "vllm"},
            {"url": p1, "name": "prefill-1", "role": "prefill", "kind": "vllm"},
            {"url": decode, "name": "decode-0", "role": "decode", "kind": "vllm"},
        ]
        pool = {
            "endpoints": endpoints,
            "pd": {"min_uncached_tokens": 64},
            "policy": {**POLICY, "args": {"prefill_first": "prefill-1"}},
        }
        gw = await gateway(gateway_settings([], pool=pool))
        policy = recorder(gw)
        body = {"model": "m", "prompt": LONG, "max_tokens": 2}
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            r = await c.post("/v1/completions", json=body, headers={ID_HEADER: "pd"})
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "decode-0"
        assert await seen(p0) == []
        (p_leg,) = await seen(p1)
        assert p_leg["body"]["max_tokens"] == 1
        ended = await ended_once(policy, "pd")
        assert ended.replica == "decode-0" and ended.outcome.prefill_replica == "prefill-1"
        assert ended.outcome.ok and policy.pairs == 1
