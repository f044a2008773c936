"""The simulator's KV event replay socket, as vLLM 0.26's ZmqEventPublisher serves it, driven by real
ZMQ clients against a simulator process: batches dropped and reordered on purpose (the fault switch),
the missed ones asked for again by sequence number, bounded by `buffer_steps`."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from bench.procs import Child, free_port_range, python_module
from tests.conftest import STARTUP_S

END = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 4


@pytest.fixture(params=["vllm", "sglang"])
def sim(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str, str]]:
    """A simulator process publishing KV events with a replay endpoint: (HTTP URL, PUB, ROUTER, api)."""
    port = free_port_range(3)
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port + 1}",
        "replay_endpoint": f"tcp://*:{port + 2}",
        "buffer_steps": BUFFER_STEPS,
    }
    argv = python_module(
        "gateway.sim", "--model", "m", "--profile", "tiny", "--speedup", "50", "--port", str(port),
        "--kv-events-config", json.dumps(cfg), "--api", request.param,
    )  # fmt: skip
    child = Child("sim", argv, tmp_path / "sim.log").start()
    url = f"http://127.0.0.1:{port}"
    with child:
        child.wait_ready([f"{url}/health"], STARTUP_S)
        yield url, f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port + 2}", request.param


def recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    if not sock.poll(int(STARTUP_S * 1000)):
        raise AssertionError("no message within the startup allowance")
    return sock.recv_multipart()


def replay(dealer: zmq.Socket[bytes], start: int, api: str) -> list[tuple[int, bytes]]:
    """Ask for every kept batch from `start` on; (seq, payload) until the end marker. vLLM's replies
    carry the topic frame (`[b"", topic, seq, payload]`), SGLang's do not (`[b"", seq, payload]`)."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[tuple[int, bytes]] = []
    while True:
        frames = recv(dealer)
        assert frames[0] == b""
        if api == "vllm":
            assert len(frames) == 4 and frames[1] == b""  # the publisher's topic, vLLM's default ""
        else:
            assert len(frames) == 3
        seq, payload = frames[-2:]
        if seq == END:
            assert payload == b""
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def test_missed_batches_are_replayed_by_sequence_number_within_the_buffer(
    sim: tuple[str, str, str, str],
) -> None:
    url, pub, router, api = sim
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(router)
    prompts = (list(range(1000 * k, 1000 * k + 32)) for k in itertools.count(1))
    try:
        with httpx.Client(timeout=STARTUP_S) as http:

            def one_request() -> None:  # one prompt, one step: one batch of BlockStored events
                body = {"model": "m", "prompt": next(prompts), "max_tokens": 1}
                assert http.post(f"{url}/v1/completions", json=body).status_code == 200

            # A SUB socket misses what is published before it is connected: probe until one arrives.
            while not sub.poll(100):
                one_request()
            last = http.post(f"{url}/sim/kv_events/faults", json={}).json()["next_seq"] - 1
            while int.from_bytes(recv(sub)[1], "big") != last:  # up to what the probes published
                pass

            fault = http.post(f"{url}/sim/kv_events/faults", json={"drop": 2})
            assert fault.json()["next_seq"] == last + 1
            for _ in range(3):
                one_request()
            _, seq, payload = recv(sub)
            assert int.from_bytes(seq, "big") == last + 3  # a gap of two
            kept = replay(dealer, last + 1, api)
            assert [s for s, _ in kept] == [last + 1, last + 2, last + 3]
            assert kept[-1][1] == payload  # replayed as published
            for _, p in kept[:2]:
                batch = msgpack.unpackb(p)
                if api == "vllm":  # [ts, events, dp_rank], events tagged maps
                    assert batch[2] == 0 and batch[1][0]["type"] == "BlockStored"
                else:  # SGLang: [ts, events], events array-like
                    assert len(batch) == 2 and batch[1][0][0] == "BlockStored"

            # Bounded: from 0, only the last `buffer_steps` batches are left; the client sees the gap
            # in the first number it gets back.
            assert [s for s, _ in replay(dealer, 0, api)] == list(range(last + 4 - BUFFER_STEPS, last + 4))
            # A request the ROUTER cannot read (vLLM wants exactly identity, b"", seq) gets no answer:
            # the next answer is the valid request's, the end marker alone for a number not published yet.
            dealer.send_multipart([b"", b"\x00", b"extra"])
            assert replay(dealer, last + 100, api) == []

            http.post(f"{url}/sim/kv_events/faults", json={"reorder": 1})
            one_request()
            one_request()
            got = [int.from_bytes(recv(sub)[1], "big") for _ in range(2)]
            assert got == [last + 5, last + 4]
            bad = http.post(f"{url}/sim/kv_events/faults", json={"drop": -1})
            body = bad.json()
            assert bad.status_code == 400 and (body.get("error") or body)["message"]  # SGLang's is flat
    finally:
        sub.close(0)
        dealer.close(0)
