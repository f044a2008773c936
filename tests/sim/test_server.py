"""The simulator's HTTP API on real loopback sockets, driven by the openai SDK, httpx and pyzmq."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgpack
import openai
import pytest
import zmq
import zmq.asyncio

from gateway.sim.engine import Request
from gateway.sim.faults import FaultConfig
from gateway.sim.kv_cache import block_hashes
from gateway.sim.serving_flags import ServingOptions
from tests.conftest import wait_until
from tests.sim.conftest import MODEL, engine, replica, state, url

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 300}], "max_tokens": 4}


async def test_openai_sdk_streaming_and_not_with_cached_tokens() -> None:
    async with replica() as r:
        client = openai.AsyncOpenAI(base_url=f"{url(r)}/v1", api_key="x")
        msgs = [{"role": "system", "content": "You are terse. " * 100}, {"role": "user", "content": "Hi"}]
        first = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)  # type: ignore[arg-type]
        assert first.choices[0].finish_reason == "length"
        assert first.usage is not None and first.usage.completion_tokens == 5
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert text == first.choices[0].message.content + text[len(first.choices[0].message.content or "") :]
        assert usage is not None and usage.completion_tokens == 7
        full_blocks = (usage.prompt_tokens - 1) // 16 * 16
        assert usage.prompt_tokens_details.cached_tokens == full_blocks  # type: ignore[union-attr]

        comp = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=3, n=2)
        assert [c.index for c in comp.choices] == [0, 1] and comp.usage.completion_tokens == 6  # type: ignore[union-attr]
        await client.close()


async def test_sse_framing_usage_chunk_and_done() -> None:
    async with replica() as r, httpx.AsyncClient() as c:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", f"{url(r)}/v1/chat/completions", json=body) as resp:
            raw = (await resp.aread()).decode()
        events = raw.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        assert all(e.startswith("data: ") for e in events[:-1])
        assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
        assert payloads[-2]["choices"][0]["finish_reason"] == "length"


async def test_request_validation_and_error_forms() -> None:
    async with replica() as r, httpx.AsyncClient() as c:
        bad = await c.post(
            f"{url(r)}/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options"
        assert (
            await c.post(f"{url(r)}/v1/chat/completions", json={**CHAT, "model": "nope"})
        ).status_code == 404
        too_long = await c.post(
            f"{url(r)}/v1/completions", json={"model": MODEL, "prompt": [1] * 10, "max_tokens": 10**7}
        )
        assert (
            too_long.status_code == 400
            and "cannot be greater than max_model_len" in too_long.json()["error"]["message"]
        )
        prio = await c.post(f"{url(r)}/v1/chat/completions", json={**CHAT, "priority": 3})
        assert prio.status_code == 400  # like vLLM without --scheduling-policy priority
    async with replica(api="sglang") as r, httpx.AsyncClient() as c:
        bad = await c.post(f"{url(r)}/v1/chat/completions", json={**CHAT, "model": "nope"})
        body = bad.json()
        assert body["object"] == "error" and body["code"] == 404 and "message" in body
        loads = (await c.get(f"{url(r)}/v1/loads")).json()["loads"][0]
        assert {"num_running_reqs", "num_waiting_reqs", "token_usage", "cache_hit_rate"} <= set(loads)
        assert "sglang:num_queue_reqs" in (await c.get(f"{url(r)}/metrics")).text


async def test_request_log_keeps_unknown_fields_and_echoes_request_id() -> None:
    async with replica() as plain, httpx.AsyncClient() as c:  # like vLLM: no echo unless asked
        resp = await c.post(f"{url(plain)}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "rid-0"})
        assert resp.status_code == 200 and "x-request-id" not in resp.headers
    async with replica(serving=ServingOptions(request_id_headers=True)) as r, httpx.AsyncClient() as c:
        body = {**CHAT, "user": "u1", "cache_salt": "s", "custom_field": {"a": 1}}
        resp = await c.post(f"{url(r)}/v1/chat/completions", json=body, headers={"X-Request-Id": "rid-1"})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "rid-1"
        last = (await c.get(f"{url(r)}/sim/requests", params={"last": 1})).json()[0]
        assert last["request_id"] == "rid-1" and last["body"]["custom_field"] == {"a": 1}
        assert {"user", "cache_salt", "custom_field"} <= set(last["body_keys"])
        models = (await c.get(f"{url(r)}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        unbounded = (await c.post(f"{url(r)}/v1/completions", json={"model": MODEL, "prompt": "hi"})).json()
        assert unbounded["choices"][0]["finish_reason"] == "stop"
        assert unbounded["usage"]["completion_tokens"] == 64  # --default-max-tokens
        # Every answer, errors and GETs included (vLLM's middleware); a fresh id without one.
        bad = await c.post(f"{url(r)}/v1/chat/completions", json={}, headers={"X-Request-Id": "rid-2"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "rid-2"
        assert len((await c.get(f"{url(r)}/health")).headers["x-request-id"]) == 32


async def test_429_beyond_max_waiting_and_disconnect_frees_blocks() -> None:
    async with (
        replica(speedup=1.0, max_waiting=1, engine_kw={"max_num_seqs": 1}) as r,
        httpx.AsyncClient(timeout=30) as c,
    ):
        long = {**CHAT, "max_tokens": 20_000, "stream": True}
        running = asyncio.create_task(c.post(f"{url(r)}/v1/chat/completions", json=long))
        await wait_until(lambda: _field(c, r, "running", 1), 10)
        queued = asyncio.create_task(c.post(f"{url(r)}/v1/chat/completions", json=long))
        await wait_until(lambda: _field(c, r, "waiting", 1), 10)
        rejected = await c.post(f"{url(r)}/v1/chat/completions", json=CHAT)
        assert rejected.status_code == 429 and rejected.headers["Retry-After"] == "1"
        assert (await state(c, r))["used_blocks"] > 0
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        await wait_until(lambda: _idle(c, r), 10)


async def _field(c: httpx.AsyncClient, r: object, key: str, value: int) -> bool:
    return (await state(c, r))[key] == value  # type: ignore[arg-type]


async def _idle(c: httpx.AsyncClient, r: object) -> bool:
    s = await state(c, r)  # type: ignore[arg-type]
    return s["running"] == 0 and s["waiting"] == 0 and s["used_blocks"] == 0


async def test_fault_header_status_stall_midstream() -> None:
    async with replica() as r, httpx.AsyncClient() as c:
        resp = await c.post(f"{url(r)}/v1/chat/completions", json=CHAT, headers={"x-sim-fault": "status=503"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
        t0 = time.monotonic()
        resp = await c.post(f"{url(r)}/v1/chat/completions", json=CHAT, headers={"x-sim-fault": "stall=0.3"})
        assert resp.status_code == 200 and time.monotonic() - t0 >= 0.3
        body = {**CHAT, "max_tokens": 50, "stream": True}
        got: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with c.stream(
                "POST", f"{url(r)}/v1/chat/completions", json=body, headers={"x-sim-fault": "midstream=3"}
            ) as s:
                async for line in s.aiter_lines():
                    if line:
                        got.append(line)
        assert len(got) == 3 and "[DONE]" not in got[-1]
        bad = await c.post(f"{url(r)}/v1/chat/completions", json=CHAT, headers={"x-sim-fault": "explode"})
        assert bad.status_code == 400
        await wait_until(lambda: _idle(c, r), 10)


async def test_crash_fault_takes_the_replica_down() -> None:
    async with replica() as r, httpx.AsyncClient() as c:
        with pytest.raises(httpx.RemoteProtocolError):  # like a dying process: no response at all
            await c.post(f"{url(r)}/v1/chat/completions", json=CHAT, headers={"x-sim-fault": "crash"})
        with pytest.raises(httpx.ConnectError):
            await c.get(f"{url(r)}/health")


async def test_health_is_503_during_startup_delay() -> None:
    async with replica(startup_delay_s=0.4) as r, httpx.AsyncClient() as c:
        assert (await c.get(f"{url(r)}/health")).status_code == 503
        assert (await c.post(f"{url(r)}/v1/chat/completions", json=CHAT)).status_code == 503

        async def healthy() -> bool:
            return (await c.get(f"{url(r)}/health")).status_code == 200

        await wait_until(healthy, 10)


async def test_metrics_match_what_happened() -> None:
    async with replica() as r, httpx.AsyncClient() as c:
        usages = []
        for _ in range(3):
            usages.append((await c.post(f"{url(r)}/v1/chat/completions", json=CHAT)).json()["usage"])
        text = (await c.get(f"{url(r)}/metrics")).text
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#") and "_bucket" not in line
        }
        assert values["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
        assert values["vllm:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
        assert values["vllm:prefix_cache_hits_total"] == sum(
            u["prompt_tokens_details"]["cached_tokens"] for u in usages
        )
        assert values["vllm:prefix_cache_queries_total"] == values["vllm:prompt_tokens_total"]
        assert values["vllm:time_to_first_token_seconds_count"] == 3
        assert values["vllm:e2e_request_latency_seconds_count"] == 3
        assert values["vllm:num_requests_running"] == 0
        assert f'num_gpu_blocks="{r.engine.pool.num_blocks}"' in text and 'model_name="sim-model"' in text


async def test_vllm_nixl_pd_legs() -> None:
    producer = {"kv_role": "kv_producer"}
    consumer = {"kv_role": "kv_consumer"}
    async with replica(kv_role=producer["kv_role"]) as p, replica(kv_role=consumer["kv_role"]) as d:
        async with httpx.AsyncClient() as c:
            leg1 = {
                **CHAT,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
            }
            pre = (
                await c.post(f"{url(p)}/v1/chat/completions", json=leg1, headers={"x-request-id": "pd1"})
            ).json()
            ktp = pre["kv_transfer_params"]
            assert ktp["remote_block_ids"] and ktp["remote_port"] == p.port and ktp["tp_size"] == 1
            assert (await state(c, p))["leased_requests"] == 1
            leg2 = {**CHAT, "max_tokens": 5, "kv_transfer_params": ktp}
            dec = (
                await c.post(f"{url(d)}/v1/chat/completions", json=leg2, headers={"x-request-id": "pd1"})
            ).json()
            assert dec["usage"]["completion_tokens"] == 5
            # As vLLM: the transferred tokens count as cached, all but the one the decode computes.
            prompt = dec["usage"]["prompt_tokens"]
            assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
            text = (await c.get(f"{url(d)}/metrics")).text
            assert "vllm:external_prefix_cache_hits_total{" in text
            assert d.engine.metrics.external_prefix_cache_hits == prompt - 1
            assert d.engine.metrics.kv_transfer_time.count == 1
            seen = (await state(c, d))["recent"][-1]
            assert seen["kv_transfer_params"]["remote_block_ids"] == ktp["remote_block_ids"]
            await wait_until(lambda: _field(c, p, "leased_requests", 0), 10)  # the decode side released them
            assert d.engine.metrics.prefix_cache_hits == 0


async def test_sglang_bootstrap_pd_same_body_to_both() -> None:
    async with (
        replica(api="sglang", disaggregation_mode="prefill", bootstrap_port=0) as p,
        replica(api="sglang", disaggregation_mode="decode") as d,
        httpx.AsyncClient() as c,
    ):
        body = {
            **CHAT,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": 42,
        }
        dec_task = asyncio.create_task(c.post(f"{url(d)}/v1/chat/completions", json=body))
        await asyncio.sleep(0)  # the decode leg may well arrive first: it must wait for the room
        pre = await c.post(f"{url(p)}/v1/chat/completions", json=body)
        dec = await dec_task
        assert pre.status_code == dec.status_code == 200
        assert dec.json()["usage"]["completion_tokens"] == 4
        assert pre.json()["usage"]["completion_tokens"] == 1
        assert (await state(c, d))["recent"][-1]["bootstrap"]["bootstrap_room"] == 42


async def test_kv_events_over_zmq_match_blocks_stored() -> None:
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "topic": "kv"}
    async with replica(kv_events=cfg) as r, httpx.AsyncClient() as c:
        sub.connect(r.kv_pub.endpoint)  # type: ignore[union-attr]
        # ZMQ slow joiner: a PUB drops what it sends before the SUB has joined, so probe until one arrives.
        probes = iter(range(1, 10_000))

        async def probe() -> list[bytes] | None:
            prompt = [next(probes)] * 32
            await c.post(f"{url(r)}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            try:
                return await asyncio.wait_for(sub.recv_multipart(), 0.1)
            except TimeoutError:
                return None

        _, probe_seq, _ = await wait_until(probe, 10, "a first KV event", interval=0)
        await c.post(f"{url(r)}/v1/chat/completions", json=CHAT)
        tokens = (await c.post(f"{url(r)}/tokenize", json={"messages": CHAT["messages"]})).json()["tokens"]
        topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert ts > 0
        assert topic == b"kv" and dp_rank == 0
        assert int.from_bytes(seq, "big") == int.from_bytes(probe_seq, "big") + 1  # 8-byte big-endian counter
        # vLLM 0.26.0's events are tagged maps (not array-like structs).
        stored = [h for ev in events if ev["type"] == "BlockStored" for h in ev["block_hashes"]]
        assert stored == block_hashes(tokens, 16)
        first = next(ev for ev in events if ev["type"] == "BlockStored")
        full = len(tokens) // 16 * 16
        assert len(events) == 1  # one request's chain of blocks: one event, as vLLM sends it
        assert first["parent_block_hash"] is None and first["token_ids"] == tokens[:full]
        assert (first["block_size"], first["medium"], first["group_idx"]) == (16, "GPU", 0)
        assert "extra_keys" not in first and "locality" not in first  # defaults left out, as msgspec does
    sub.close(0)


async def test_wall_clock_pacing_reproduces_the_virtual_clock() -> None:
    ids = list(range(1000, 4000))
    virtual = engine("tiny")
    req = Request("v", ids, 3, block_size=16)
    virtual.add_request(req)
    virtual.run_until_idle()
    async with replica(speedup=20.0) as r, httpx.AsyncClient() as c:
        await c.post(f"{url(r)}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 3})
        text = (await c.get(f"{url(r)}/metrics")).text
    ttft_sum = next(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_sum")
    )
    assert ttft_sum == pytest.approx(req.ttft, rel=0.01)  # simulated seconds, not wall seconds


async def test_configured_faults_error_rate_and_crash_after() -> None:
    async with replica(faults=FaultConfig(error_rate=1.0, error_status=502)) as r, httpx.AsyncClient() as c:
        resp = await c.post(f"{url(r)}/v1/chat/completions", json=CHAT)
        assert resp.status_code == 502 and resp.json()["error"]["code"] == 502
    async with replica(faults=FaultConfig(crash_after=1)) as r, httpx.AsyncClient() as c:
        assert (await c.post(f"{url(r)}/v1/chat/completions", json=CHAT)).status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(f"{url(r)}/v1/chat/completions", json=CHAT)
        assert r.crashed


async def test_next_turn_hits_on_the_previous_answer() -> None:
    async with replica() as r, httpx.AsyncClient() as c:
        turn1 = [
            {"role": "system", "content": "Be brief. " * 40},
            {"role": "user", "content": "Name things."},
        ]
        first = (
            await c.post(f"{url(r)}/v1/chat/completions", json={**CHAT, "messages": turn1, "max_tokens": 48})
        ).json()
        answer = first["choices"][0]["message"]["content"]
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
        second = (await c.post(f"{url(r)}/v1/chat/completions", json={**CHAT, "messages": turn2})).json()
        p1 = first["usage"]["prompt_tokens"]
        # Every full block of prompt + the 47 answer tokens whose KV was computed, like vLLM.
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (p1 + 47) // 16 * 16 > p1
