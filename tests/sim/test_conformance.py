"""The simulator against recorded vLLM behaviour (tests/sim/vllm_conformance.yaml): status, error type,
param, message fragments and field layouts for the same requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.sim.conftest import cli_replica

FIXTURE = Path(__file__).parent / "vllm_conformance.yaml"
CASES: list[dict[str, Any]] = yaml.safe_load(FIXTURE.read_text())["cases"]
SERVERS = {
    "plain": ("--served-model-name", "m", "alias", "--max-model-len", "4096"),
    "pooling": ("--runner", "pooling", "--embedding-dim", "32"),
}


def at(doc: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
async def test_simulator_answers_as_vllm(case: dict[str, Any], strict_sim: str) -> None:
    if case["server"] == "strict":
        await _check(case, strict_sim)
    else:
        async with cli_replica(*SERVERS[case["server"]]) as base:
            await _check(case, base)


async def _check(case: dict[str, Any], base: str) -> None:
    exp = case["expect"]
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        if "raw" in case:
            headers = {"content-type": case.get("content_type", "application/json")}
            resp = await c.post(case["path"], content=case["raw"], headers=headers)
        else:
            resp = await c.request(case.get("method", "POST"), case["path"], json=case.get("body"))
    assert resp.status_code == exp["status"], resp.text
    body = resp.json()
    if "type" in exp or "param" in exp or "message" in exp:
        err = body["error"]
        assert err["code"] == exp["status"]
        if "type" in exp:
            assert err["type"] == exp["type"], err
        if "param" in exp:
            assert err["param"] == exp["param"], err
        for fragment in exp.get("message", []):
            assert fragment in err["message"], err["message"]
    for path, value in exp.get("json", {}).items():
        assert at(body, path) == value, (path, body)
    for path, keys in exp.get("keys", {}).items():
        assert set(keys) <= set(at(body, path)), (path, body)
