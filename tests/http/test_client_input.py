"""Bad or awkward client input gets a clear 4xx, never a 500, and never reaches logs raw."""

from __future__ import annotations

import asyncio
import gzip
import logging
import re
import zlib

import httpx
import orjson
import pytest

from gateway.logs import TextFormatter
from gateway.path.stream_end import StreamEnd
from gateway.prompt.prefix_hash import PrefixHasher
from tests.conftest import gateway_settings, wait_until
from tests.rawhttp import closed_within, exchange, post, read_response

COMPLETIONS = "/v1/completions"
OK_BODY = orjson.dumps({"model": "m", "prompt": "hello"})


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return str(err["message"])


async def test_deeply_nested_json_is_a_400_in_every_field(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], server={"max_json_depth": 10}))
    nest = "[" * 12 + "]" * 12
    bodies = [
        '{"model":"m","prompt":"x","extra":' + nest + "}",
        '{"model":"m","prompt":' + nest + "}",
        '{"model":"m","messages":[{"role":"user","content":' + nest + "}]}",
        '{"model":"m","messages":[{"role":"user","content":"x"}],"tools":' + nest + "}",
        '{"model":"m","prompt":"x","x":' + "[" * 2000 + "]" * 2000 + "}",  # past orjson's own limit
    ]
    async with httpx.AsyncClient() as c:
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else COMPLETIONS
            _error(await c.post(gw.url + path, content=body.encode()), 400, "invalid_json")
        nine = '{"model":"m","prompt":"x","extra":' + "[" * 8 + "]" * 8 + "}"  # 9 levels: fits
        assert (await c.post(gw.url + COMPLETIONS, content=nine.encode())).status_code == 200
    assert len(up.state.seen) == 1


async def test_work_one_request_asks_for_is_bounded(upstreams, gateway):
    """Issue 26: n 100000, a batch of 500,000 prompts, 100,000 embedding inputs were forwarded."""
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], pool={"tasks": ["generate", "embed"]}))
    many = [f"p{i}" for i in range(100_000)]
    async with httpx.AsyncClient(timeout=30) as c:
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        r = await c.post(gw.url + "/v1/chat/completions", json={**chat, "n": 100_000})
        assert "server.max_n" in _error(r, 400, "too_many_choices") and r.json()["error"]["param"] == "n"
        r = await c.post(gw.url + COMPLETIONS, json={"model": "m", "prompt": many, "n": 2})
        _error(r, 400, "too_many_prompts")
        assert r.json()["error"]["param"] == "prompt"
        r = await c.post(gw.url + "/v1/embeddings", json={"model": "m", "input": many})
        _error(r, 400, "too_many_inputs")
        assert r.json()["error"]["param"] == "input"
        r = await c.post(gw.url + "/v1/rerank", json={"model": "m", "query": "q", "documents": many})
        _error(r, 400, "too_many_inputs")
        assert not up.state.seen  # refused before anything reached an engine
        # At the caps, and a list of token ids being one prompt, all pass.
        assert (await c.post(gw.url + "/v1/chat/completions", json={**chat, "n": 128})).status_code == 200
        batch = {"model": "m", "prompt": many[:256]}
        assert (await c.post(gw.url + COMPLETIONS, json=batch)).status_code == 200
        ids = {"model": "m", "prompt": list(range(5000))}
        assert (await c.post(gw.url + COMPLETIONS, json=ids)).status_code == 200
    assert len(up.state.seen) == 3


async def test_a_capped_count_must_be_an_integer_and_prompts_times_choices_are_capped(upstreams, gateway):
    """Issue 35: `"n": "1000"`, `" 1000"`, `1000.0`, `1e3` went past server.max_n (the engine reads
    them as 1,000), and 256 prompts x n 128 = 32,768 sequences were accepted."""
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(timeout=30) as c:
        for n in ("1000", " 1000", 1000.0, 1e3, "2", True, [3]):
            r = await c.post(gw.url + "/v1/chat/completions", json={**chat, "n": n})
            assert r.json()["error"]["param"] == "n" and "integer" in _error(r, 400, "invalid_type"), n
        r = await c.post(gw.url + COMPLETIONS, json={"model": "m", "prompt": "x", "best_of": "1000"})
        assert r.json()["error"]["param"] == "best_of" and _error(r, 400, "invalid_type")
        r = await c.post(gw.url + COMPLETIONS, json={"model": "m", "prompt": "x", "best_of": 1000})
        _error(r, 400, "too_many_choices")
        batch = {"model": "m", "prompt": [f"p{i}" for i in range(256)], "n": 128}
        r = await c.post(gw.url + COMPLETIONS, json=batch)
        assert "32768 sequences" in _error(r, 400, "too_many_sequences")
        assert not up.state.seen  # refused before anything reached an engine
        ok = await c.post(gw.url + COMPLETIONS, json={**batch, "n": 4})  # 1,024 sequences: the cap
        assert ok.status_code == 200 and len(up.state.seen) == 1


async def test_work_caps_are_configurable(upstreams, gateway):
    (up,) = await upstreams(1)
    server = {"max_n": 2, "max_prompts": 3, "max_inputs": 4}
    gw = await gateway(gateway_settings([up.url], server=server, pool={"tasks": ["generate", "embed"]}))
    async with httpx.AsyncClient() as c:
        _error(
            await c.post(gw.url + COMPLETIONS, json={"model": "m", "prompt": "x", "n": 3}),
            400,
            "too_many_choices",
        )
        r = await c.post(gw.url + COMPLETIONS, json={"model": "m", "prompt": ["a", "b", "c", "d"]})
        _error(r, 400, "too_many_prompts")
        r = await c.post(gw.url + "/v1/embeddings", json={"model": "m", "input": ["a"] * 5})
        _error(r, 400, "too_many_inputs")
        ok = await c.post(gw.url + COMPLETIONS, json={"model": "m", "prompt": ["a", "b", "c"], "n": 2})
        assert ok.status_code == 200
    assert len(up.state.seen) == 1


async def test_compressed_bodies_are_decoded_within_the_size_limit(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], server={"max_body_bytes": 10_000}))
    url = gw.url + COMPLETIONS
    bomb = gzip.compress(orjson.dumps({"model": "m", "prompt": "a" * 1_000_000}))
    assert len(bomb) < 10_000
    async with httpx.AsyncClient() as c:

        async def send(body: bytes, coding: str) -> httpx.Response:
            return await c.post(url, content=body, headers={"content-encoding": coding})

        assert (await send(gzip.compress(OK_BODY), "gzip")).status_code == 200
        assert (await send(zlib.compress(OK_BODY), "deflate")).status_code == 200
        assert (await send(OK_BODY, "identity")).status_code == 200
        _error(await send(bomb, "gzip"), 413, "request_too_large")
        _error(await send(OK_BODY, "gzip"), 400, "invalid_body")  # says gzip, is not
        _error(await send(gzip.compress(OK_BODY)[:-12], "gzip"), 400, "invalid_body")  # cut short
        _error(await send(gzip.compress(OK_BODY) + b"junk", "gzip"), 400, "invalid_body")
        _error(await send(OK_BODY, "br"), 415, "unsupported_content_encoding")
    assert [s.body["prompt"] for s in up.state.seen] == ["hello"] * 3


async def test_header_values_outside_visible_ascii_are_a_400(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    for value in ("€".encode(), b"caf\xe9", b"\xff\xfe"):
        raw = post(COMPLETIONS, OK_BODY).replace(b"\r\n\r\n", b"\r\nx-a: " + value + b"\r\n\r\n", 1)
        r = await exchange(gw.port, raw)
        assert r.status == 400 and r.json()["error"]["code"] == "invalid_header"  # type: ignore[index]
    tabs = post(COMPLETIONS, OK_BODY, "x-a: tab\tand space ok")
    assert (await exchange(gw.port, tabs)).status == 200
    assert len(up.state.seen) == 1


async def test_client_strings_cannot_forge_or_flood_log_lines(upstreams, gateway, caplog):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    caplog.set_level(logging.INFO)
    forged = "m\n2026-01-01 00:00:00,000 ERROR gateway.control.admin: forged\r\x1b[31m"
    async with httpx.AsyncClient() as c:
        r1 = await c.post(gw.url + COMPLETIONS, json={"model": forged, "prompt": "p"})
        r2 = await c.post(gw.url + COMPLETIONS, json={"model": "x" * 1_000_000, "prompt": "p"})
    message = _error(r1, 404, "model_not_found")
    assert "\n" not in message and "\x1b" not in message
    assert len(_error(r2, 404, "model_not_found")) < 400
    formatter = TextFormatter()
    lines = [line for rec in caplog.records for line in formatter.format(rec).split("\n")]
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")
    assert lines and all(stamp.match(line) for line in lines), lines
    assert not any("ERROR gateway.control.admin" in line[:40] for line in lines)
    assert max(map(len, lines)) < 5_000


async def test_a_body_that_stops_arriving_gets_a_408(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], server={"body_timeout_s": 0.3}))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(post(COMPLETIONS, OK_BODY)[: -len(OK_BODY) + 5])  # headers and 5 body bytes
    r = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert r.status == 408 and r.json()["error"]["code"] == "request_timeout"  # type: ignore[index]
    assert up.state.seen == []


async def test_a_stream_read_to_its_end_then_closed_counts_as_completed(upstreams, gateway, caplog):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    caplog.set_level(logging.INFO, logger="kvgate.access")
    body = orjson.dumps({"model": "m", "prompt": "p", "stream": True})

    async def read_then_close(mode: str, until: bytes) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(post(COMPLETIONS, body, f"x-test-mode: {mode}"))
        await reader.readuntil(until)
        writer.close()

    # The engine holds the stream open after [DONE]: the client has everything and leaves.
    await read_then_close("linger:2", b"data: [DONE]\n\n")
    # The client leaves with the stream half read.
    await read_then_close("hang-stream", b"tok0")
    await wait_until(lambda: len(_access(caplog)) == 2, what="two access log lines")
    done, gone = _access(caplog)
    assert done["status"] == 200 and "client_disconnected" not in done
    assert gone["status"] == 499 and gone["client_disconnected"] is True
    async with httpx.AsyncClient() as c:
        metrics = (await c.get(gw.url + "/metrics")).text
    assert re.search(r'kvgate_requests_total\{[^}]*status="200"[^}]*\} 1\.0', metrics)
    assert re.search(r'kvgate_requests_total\{[^}]*status="499"[^}]*\} 1\.0', metrics)


@pytest.mark.parametrize(
    ("endpoint", "chunks", "complete"),
    [
        ("chat", [b"data: {}\n\n", b"data: [DO", b"NE]\n\n"], True),  # the marker split in two
        ("chat", [b'data: {"content": "data: [DONE]"}\n\n'], False),  # the words, inside an event
        ("chat", [b"data: [DONE]\n\n", b"data: {}\n\n"], False),  # not the last thing written
        ("responses", [b"event: response.completed\ndata: {", b'"a": 1}\n\n'], True),
        ("responses", [b"event: response.completed\ndata: {"], False),  # its data not all written
        ("responses", [b"event: response.output_text.delta\ndata: {}\n\n"], False),
    ],
)
def test_stream_end_is_the_last_event_written_whole(endpoint, chunks, complete):
    end = StreamEnd(endpoint)
    for chunk in chunks:
        end.feed(chunk)
    assert end.complete is complete


def _access(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.fields for r in caplog.records if r.name == "kvgate.access"]  # type: ignore[attr-defined]


async def test_large_bodies_are_measured_off_the_loop_exactly_as_small_ones(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], server={"offload_body_bytes": 1000}))
    pool = gw.runtime.routers["p"]
    text = " ".join(f"word{i % 97}" for i in range(20_000))
    body = {"model": "m", "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}]}
    async with httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200
    # What the worker thread learned joined the pool's caches on the loop.
    assert pool.hasher.cached_blocks() > 0
    inline = pool.features(body, "chat", "r", {})
    for hasher in (pool.hasher.detached(), PrefixHasher(pool.pool.cfg.prefix.block_chars)):
        detached = pool.features(body, "chat", "r", {}, hasher)
        assert detached.block_hashes == inline.block_hashes and detached.block_tokens == inline.block_tokens
    # The offloaded request was learned under the same hashes the inline path computes.
    assert pool.match.index.match(inline.block_hashes, ["r0"])["r0"] == len(inline.block_hashes)


async def test_header_and_idle_timeouts_close_waiting_connections(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(
        gateway_settings([up.url], server={"header_timeout_s": 0.3, "keepalive_timeout_s": 0.6})
    )
    silent = await asyncio.open_connection("127.0.0.1", gw.port)
    partial = await asyncio.open_connection("127.0.0.1", gw.port)
    partial[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")  # a head never finished
    used = await asyncio.open_connection("127.0.0.1", gw.port)
    used[1].write(post(COMPLETIONS, OK_BODY))
    assert (await read_response(used[0])).status == 200
    started = asyncio.get_running_loop().time()
    assert await closed_within(silent[0], 3) and await closed_within(partial[0], 3)
    assert await closed_within(used[0], 3)
    assert asyncio.get_running_loop().time() - started < 2.5
    for _, writer in (silent, partial, used):
        writer.close()
    closed = gw.runtime.connections.closed  # type: ignore[union-attr]
    assert closed["header_timeout"] == 2 and closed["idle_timeout"] == 1
    assert gw.runtime.connections.open == 0  # type: ignore[union-attr]
