"""What a client reads of an engine that failed: the replica's name, never the engine's address,
which stays in the gateway's logs."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.conftest import free_port
from tests.hostile_upstream import TRANSPORTS, ask, hostile_settings, marker, openai_error


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_an_unreachable_engine_is_named_by_its_replica(
    transport: str, gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    port = free_port()  # nothing listens there: every connect is refused
    gw = await gateway(hostile_settings([f"http://127.0.0.1:{port}"], transport))
    async with httpx.AsyncClient() as c:
        answers = [
            await ask(c, gw, marker()),
            await c.post(gw.url + "/tokenize", json={"model": "m", "prompt": "hi"}),
        ]
    for r in answers:
        err = openai_error(r)
        assert r.status_code == 502 and err["code"] == "upstream_unreachable"
        assert err["message"].startswith("replica r0: ") and "engine" in err["message"]
        assert str(port) not in r.text and "127.0.0.1" not in r.text
    assert f"127.0.0.1:{port}" in caplog.text  # the operator still learns where it failed
