"""What of a client's request reaches engines: a real gateway and real upstreams (the PD legs are
checked in tests/path/test_pd.py)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.conftest import gateway_settings
from tests.rawhttp import exchange, post

STEERING_FIELDS = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1},
    "bootstrap_host": "10.9.9.9",
    "bootstrap_port": 1,
    "bootstrap_room": 7,
    "data_parallel_rank": 3,
    "routed_dp_rank": 3,
    "disagg_prefill_dp_rank": 3,
    "request_id": "someone-elses",
    "rid": "someone-elses",
    "custom_logit_processor": "gASVAAAA",
}
ENGINE_HEADERS = [
    "x-vllm-priority: -1000",
    "x-sim-fault: crash",
    "X-Data-Parallel-Rank: 2",
    "X-Request-Id: client-id-1",
    "x-sglang-anything: 1",
]
HOP_BY_HOP = [
    "Connection: keep-alive, x-hop-secret",
    "x-hop-secret: only for the next hop",
    "Keep-Alive: timeout=5",
    "TE: trailers",
    "Trailer: x-t",
    "Proxy-Authorization: Basic Zm9vOmJhcg==",
    "Proxy-Connection: keep-alive",
    "Upgrade: h2c",
]


async def test_engine_steering_fields_and_headers_never_reach_an_engine(upstreams, gateway):
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url]))
    body = {"model": "m", "prompt": "p", "user": "u-1", "vendor": {"x": 1}, **STEERING_FIELDS}
    raw = post("/v1/completions", orjson.dumps(body), *ENGINE_HEADERS, *HOP_BY_HOP, "x-custom: kept")
    r = await exchange(gw.port, raw)
    assert r.status == 200, r.body
    (got,) = up.state.seen
    assert set(got.body) == {"model", "prompt", "user", "vendor"}
    assert got.body["vendor"] == {"x": 1} and got.body["user"] == "u-1"
    names = {k.lower() for k in got.headers}
    dropped = {h.split(":")[0].lower() for h in ENGINE_HEADERS + HOP_BY_HOP} - {"x-request-id", "connection"}
    assert not names & dropped, names & dropped
    # Only the gateway's own: this engine does not echo request ids, so its connection is not kept.
    assert got.headers.getall("connection") == ["close"]
    assert got.headers["x-custom"] == "kept"
    assert got.headers.getall("x-request-id") != ["client-id-1"] and len(got.headers["x-request-id"]) == 32
    # The client still sees its own id; the access log keeps both.
    assert r.header("x-request-id") == "client-id-1"


async def test_a_pool_may_let_named_fields_and_headers_through(upstreams, gateway):
    (up,) = await upstreams(1)
    passthrough = {"body_fields": ["kv_transfer_params"], "headers": ["X-Sim-Fault"]}
    gw = await gateway(gateway_settings([up.url], pool={"client_passthrough": passthrough}))
    body = {"model": "m", "prompt": "p", **STEERING_FIELDS}
    r = await exchange(gw.port, post("/v1/completions", orjson.dumps(body), *ENGINE_HEADERS))
    assert r.status == 200
    (got,) = up.state.seen
    assert got.body["kv_transfer_params"] == STEERING_FIELDS["kv_transfer_params"]
    assert "bootstrap_host" not in got.body and "request_id" not in got.body
    assert got.headers["x-sim-fault"] == "crash" and "x-vllm-priority" not in got.headers


def _tenants(kind: str) -> dict[str, object]:
    return {
        "tenants": [
            {"name": "bulk", "api_key": "kb", "max_priority": "batch"},
            {"name": "free", "api_key": "kf"},
        ],
        "pool": {"priority_scheduling": True, "endpoints": [{"url": "", "kind": kind}]},
    }


@pytest.mark.parametrize(("kind", "urgent", "batch"), [("vllm", -1000, 0), ("sglang", 1000, 0)])
async def test_a_tenants_priority_cap_holds_for_the_body_priority(upstreams, gateway, kind, urgent, batch):
    (up,) = await upstreams(1)
    overrides = _tenants(kind)
    overrides["pool"]["endpoints"][0]["url"] = up.url  # type: ignore[index]
    gw = await gateway(gateway_settings([up.url], **overrides))
    url = gw.url + "/v1/completions"
    body = {"model": "m", "prompt": "p", "priority": urgent}
    calm = {"model": "m", "prompt": "p", "priority": -urgent}  # less urgent than batch: allowed
    async with httpx.AsyncClient() as c:
        capped = await c.post(url, json=body, headers={"authorization": "Bearer kb"})
        lowered = await c.post(url, json=calm, headers={"authorization": "Bearer kb"})
        uncapped = await c.post(url, json=body, headers={"authorization": "Bearer kf"})
        as_string = await c.post(
            url, json={**body, "priority": str(urgent)}, headers={"authorization": "Bearer kb"}
        )
        as_float = await c.post(
            url, json={**body, "priority": float(urgent)}, headers={"authorization": "Bearer kb"}
        )
    assert capped.status_code == lowered.status_code == uncapped.status_code == 200
    assert [s.body["priority"] for s in up.state.seen] == [batch, -urgent, urgent]
    for refused in (as_string, as_float):
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_priority"
