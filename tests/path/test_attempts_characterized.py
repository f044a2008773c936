"""The request path's attempts, characterized: every way an attempt can end x every mode a request
can go, against engines whose every byte the test controls, held to a table committed beside this
file (`attempts_characterized.json`).

The table was written against the attempt loop as it stood before the path was restructured, and
must hold unchanged after: for each cell, the client's status and bytes, every delivery to an
engine in order (which replica, the body it got), what the policy heard (on_routed, on_first_token,
on_complete) and the access log's account (retries, continuations, the hand-off's path).

Outcomes of the first decode (or whole) attempt, on replica d0; d1 answers whatever it is sent:

  ok                 a whole answer
  before_bytes       the connection closed before a byte of answer
  retryable_status   a well-formed 503
  status_500         a well-formed 500 (after a hand-off: the KV could not be fetched)
  kv_lost            the prefill replica ejected by health checks while d0 waits (hand-offs only)
  kv_not_loaded      an error event before any text (vLLM's kv_load_failure_policy: fail)
  cut_disconnect     two events, then the connection closed
  cut_idle           one event, then silence past the idle timeout
  cut_malformed      two events, then one that is not JSON
  cut_engine_error   two events, then an engine error event and [DONE]
  client_leaves      one event, then silence; the client closes after reading it

Modes: `plain` (a stream, failover off), `json` (not streamed, failover as configured by default),
`continuing` (a stream, failover on), `chat` (a chat stream, failover on), `vllm` and `sglang`
(a prefill/decode pool handing every prompt off, a stream, failover on).

`KVGATE_CHARACTERIZE=write pytest tests/path/test_attempts_characterized.py` rewrites the table:
only for a deliberate change of behaviour, said in its commit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import wait_until
from tests.hostile_upstream import Delivery, HostileUpstream, assert_settled, hostile_settings, marker
from tests.recording_policy import ID_HEADER, Recording

TABLE = Path(__file__).with_name("attempts_characterized.json")
WRITE = os.environ.get("KVGATE_CHARACTERIZE") == "write"

OUTCOMES = {
    "ok": "ok",
    "before_bytes": "close",
    "retryable_status": "status-503",
    "status_500": "status-500",
    "kv_lost": "hold",
    "kv_not_loaded": "error-first",
    "cut_disconnect": "close-mid-stream",
    "cut_idle": "stall-body",
    "cut_malformed": "malformed-mid-stream",
    "cut_engine_error": "error-mid-stream",
    "client_leaves": "stall-body",
}
MODES = ("plain", "json", "continuing", "chat", "vllm", "sglang")
HANDOFFS = ("vllm", "sglang")
CELLS = [
    (mode, outcome)
    for mode in MODES
    for outcome in OUTCOMES
    if (outcome != "kv_lost" or mode in HANDOFFS) and not (mode == "json" and outcome == "client_leaves")
]
_ROOM = re.compile(rb'"bootstrap_room":\d+')


class Engines:
    """The test's engines: d0 and d1 (decode or whole), and p0 in a prefill/decode pool."""

    def __init__(self) -> None:
        self.journal: list[tuple[str, Delivery]] = []
        self.servers: dict[str, HostileUpstream] = {}

    async def start(self, name: str, mode: str, script: list[str]) -> HostileUpstream:
        srv = HostileUpstream(mode, script=script, name=name, journal=self.journal)
        self.servers[name] = await srv.start()
        return srv

    async def stop(self) -> None:
        for srv in self.servers.values():
            await srv.stop()


@pytest.fixture
async def engines():
    made = Engines()
    yield made
    await made.stop()


def _settings(mode: str, engines: Engines, boot: int) -> Any:
    policy = {"type": "tests.recording_policy:Recording", "args": {"prefill_first": "p0"}}
    failover = {"mid_stream": mode != "plain"}
    d0, d1 = engines.servers["d0"], engines.servers["d1"]
    if mode not in HANDOFFS:
        endpoints = [{"url": d0.url, "name": "d0"}, {"url": d1.url, "name": "d1"}]
        return hostile_settings(
            [], "http1", pool={"policy": policy, "failover": failover, "endpoints": endpoints}
        )
    p0 = engines.servers["p0"]
    prefill: dict[str, Any] = {"url": p0.url, "name": "p0", "role": "prefill", "kind": mode}
    if mode == "vllm":
        prefill["kv_side_channel_host"] = "127.0.0.1"
    else:
        prefill["bootstrap_port"] = boot
    endpoints = [
        prefill,
        {"url": d0.url, "name": "d0", "role": "decode", "kind": mode},
        {"url": d1.url, "name": "d1", "role": "decode", "kind": mode},
    ]
    pool = {"policy": policy, "failover": failover, "endpoints": endpoints, "pd": {"min_uncached_tokens": 0}}
    settings = hostile_settings([], "http1", pool=pool)
    # Health checks eject the prefill replica in the kv_lost cell (it answers GETs 503 then).
    health = settings.health.model_copy(
        update={"enabled": True, "interval_s": 0.05, "failure_threshold": 1, "success_threshold": 1}
    )
    return settings.model_copy(update={"health": health})


def _text(raw: bytes, mark: str) -> str:
    return _ROOM.sub(b'"bootstrap_room":"ROOM"', raw).decode().replace(mark, "M")


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for event in text.split("\n\n"):
        if not event.strip():
            continue
        data = event.removeprefix("data: ")
        try:
            out.append(json.loads(data))
        except ValueError:
            out.append(data)
    return out


def _body(mode: str, mark: str) -> dict[str, Any]:
    if mode == "chat":
        return {
            "model": "m",
            "messages": [{"role": "user", "content": mark}],
            "max_tokens": 4,
            "stream": True,
        }
    return {"model": "m", "prompt": mark, "max_tokens": 4, "stream": mode != "json"}


async def _ask(gw_url: str, mode: str, outcome: str, mark: str) -> dict[str, Any]:
    path = "/v1/chat/completions" if mode == "chat" else "/v1/completions"
    headers = {ID_HEADER: "cell"}
    async with httpx.AsyncClient(timeout=30) as c:
        if outcome == "client_leaves":
            async with c.stream("POST", gw_url + path, json=_body(mode, mark), headers=headers) as r:
                got = b""
                async for piece in r.aiter_bytes():
                    got += piece
                    if b"\n\n" in got:
                        break
                return {"status": r.status_code, "replica": r.headers.get("x-kvgate-replica"), "read": got}
        r = await c.post(gw_url + path, json=_body(mode, mark), headers=headers)
        return {"status": r.status_code, "replica": r.headers.get("x-kvgate-replica"), "read": r.content}


async def _run_cell(mode: str, outcome: str, engines: Engines, gateway, caplog) -> dict[str, Any]:
    caplog.set_level(logging.INFO, "kvgate.access")
    boot = 0
    first = OUTCOMES[outcome]
    if mode in HANDOFFS:
        await engines.start("p0", "prefill-ok" if mode == "vllm" else "ok", [])
        boot = 8998  # never dialled: the decode engine would, not the gateway
    await engines.start("d0", "ok", [first])
    await engines.start("d1", "ok", [])
    gw = await gateway(_settings(mode, engines, boot))
    policy = gw.runtime.routers["p"].policy
    assert isinstance(policy, Recording)
    if mode in HANDOFFS:
        await wait_until(lambda: gw.runtime.pools["p"].replicas["p0"].available, what="p0 healthy")
    mark = marker()
    asking = asyncio.ensure_future(_ask(gw.url, mode, outcome, mark))
    if outcome == "kv_lost":
        d0 = engines.servers["d0"]
        await wait_until(lambda: d0.held == 1, what="d0 holding the decode leg")
        engines.servers["p0"].healthy = False
        await wait_until(lambda: not gw.runtime.pools["p"].replicas["p0"].available, what="p0 ejected")
        d0.release.set()
    answer = await asking
    await wait_until(lambda: policy.of("cell"), what="on_complete")
    await assert_settled(gw)
    access = [r.fields for r in caplog.records if r.name == "kvgate.access"]  # type: ignore[attr-defined]
    (ended,) = policy.of("cell")
    o = ended.outcome
    return {
        "status": answer["status"],
        "replica": answer["replica"],
        "client": _events(_text(answer["read"], mark)) if answer["read"] else [],
        # Per engine, in order; and the order of the decode (or whole) attempts. An SGLang hand-off
        # sends both legs at once: which of them arrives first is not the gateway's to say.
        "deliveries": {
            name: [{"path": d.path, "body": json.loads(_text(d.body, mark))} for d in srv.deliveries]
            for name, srv in engines.servers.items()
        },
        "attempts": [name for name, _ in engines.journal if name != "p0"],
        "policy": {
            "routed": [name for test_id, name in policy.routed if test_id == "cell"],
            "first_token": [name for test_id, name, _ in policy.first_tokens if test_id == "cell"],
            "ended": {
                "replica": ended.replica,
                "ok": o.ok,
                "status": o.status,
                "error": o.error,
                "attempts": o.attempts,
                "prefill_replica": o.prefill_replica,
            },
        },
        "access": [
            {
                k: line.get(k)
                for k in ("status", "replica", "retries", "resumed", "error", "client_disconnected")
            }
            for line in access
        ],
    }


def _table() -> dict[str, Any]:
    return orjson.loads(TABLE.read_bytes()) if TABLE.exists() else {}


@pytest.mark.parametrize(("mode", "outcome"), CELLS, ids=[f"{m}-{o}" for m, o in CELLS])
async def test_each_attempt_outcome_in_each_mode_is_as_characterized(
    mode: str, outcome: str, engines: Engines, gateway, caplog: pytest.LogCaptureFixture
) -> None:
    got = await _run_cell(mode, outcome, engines, gateway, caplog)
    key = f"{mode}/{outcome}"
    if WRITE:
        table = _table()
        table[key] = got
        TABLE.write_bytes(orjson.dumps(table, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")
        return
    assert key in _table(), f"{key} is not in {TABLE.name}: write it with KVGATE_CHARACTERIZE=write"
    want = _table()[key]
    for part in sorted(want.keys() | got.keys()):  # one part at a time, so a failure says which
        assert got.get(part) == want.get(part), f"{key}: {part}"
