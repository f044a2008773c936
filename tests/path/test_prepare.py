"""The preparation step and the request object: the body changes only through the request, which
knows whether the client's own bytes can be sent; the engine's priority field in its direction."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.admission.classes import PriorityClasses
from gateway.config import BreakerConfig, PoolConfig, SchedulerConfig, ScrapeConfig
from gateway.fleet.pool import Pool
from gateway.path.prepare import forward_priority
from gateway.path.request import InferenceRequest
from gateway.path.request_record import RequestRecord
from gateway.routing.policy import RequestFeatures
from gateway.routing.pool_router import PoolRouter


def request(body: dict[str, Any], engines: dict[str, Any] | None = None) -> InferenceRequest:
    pool = Pool(
        PoolConfig(name="p", model="m", engines=engines or {"kind": "vllm"}), BreakerConfig(), ScrapeConfig()
    )
    raw = orjson.dumps(body)
    req = InferenceRequest(
        "/v1/chat/completions", {}, raw, body, None, RequestRecord("r", "chat"), PoolRouter(pool)
    )
    req.features = RequestFeatures(request_id="r", model="m", pool="p", endpoint="chat", prompt_tokens=1)
    return req


def test_the_clients_bytes_go_out_until_the_body_changes() -> None:
    raw_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = request(dict(raw_body))
    req.drop("absent")
    assert req.strip(frozenset()) == [] and not req.dirty
    assert req.payload() is req.raw  # nothing changed: the client's own bytes, not re-serialized
    req.set("max_tokens", 4)
    assert req.dirty and orjson.loads(req.payload()) == {**raw_body, "max_tokens": 4}
    req.replace({"model": "m", "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})
    assert req.strip(frozenset()) == ["kv_transfer_params"]
    assert orjson.loads(req.payload()) == {"model": "m", "prompt": "x"}  # serialized again after each change


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        ({"kind": "vllm", "priority_scheduling": True}, -2),
        ({"kind": "sglang", "priority_scheduling": True}, 2),
        ({"kind": "sim", "priority_scheduling": True, "sim": {"extra_args": ["--api", "sglang"]}}, 2),
        ({"kind": "vllm"}, None),  # launched without priority scheduling: vLLM would refuse the field
    ],
)
def test_managed_fleet_priority_direction(engines: dict[str, Any], expected: int | None) -> None:
    req = request({}, engines)
    req.features.priority = 2
    forward_priority(req, PriorityClasses(SchedulerConfig()))
    assert req.dirty is (expected is not None)
    assert req.body.get("priority") == expected


@pytest.mark.parametrize(
    ("engines", "kept"),
    [({"kind": "vllm"}, False), ({"kind": "vllm", "priority_scheduling": True}, True)],
)
def test_a_clients_integer_priority_reaches_only_engines_that_schedule_by_it(
    engines: dict[str, Any], kept: bool
) -> None:
    req = request({"priority": 5}, engines)
    forward_priority(req, PriorityClasses(SchedulerConfig()))
    assert req.body.get("priority") == (5 if kept else None)
