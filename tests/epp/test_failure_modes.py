"""The EPP killed under the InferencePool's two failure modes, through a real Envoy: FailOpen
(ext_proc `failure_mode_allow`) still serves, Envoy picking the endpoint itself; FailClose refuses.
A deployment of its own: the test kills its EPP."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import STARTUP_S
from tests.epp.stack import epp_stack
from tests.simfleet import seen

OPEN = {"x-test-failure-mode": "open"}


async def test_epp_killed_fail_open_serves_and_fail_close_refuses(tmp_path: Path) -> None:
    with epp_stack(tmp_path, engines=2) as stack:
        # The engines' own model name: without the EPP nothing maps a route's name to it.
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        url = f"{stack.url}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=STARTUP_S) as c:
            for headers in ({}, OPEN):
                r = await c.post(url, json=body, headers=headers)
                assert r.status_code == 200
                assert r.headers["x-kvgate-replica"] in {"e0", "e1"}  # the EPP picked it
            stack.epp.kill()
            sent = sum([len(await seen(e.url, last=64)) for e in stack.engines])
            opened = await c.post(url, json=body, headers=OPEN)
            assert opened.status_code == 200, opened.text
            assert "x-kvgate-replica" not in opened.headers  # Envoy chose, without the EPP
            closed = await c.post(url, json=body)
            assert closed.status_code == 500, closed.text
            # Only the fail-open request reached an engine.
            assert sum([len(await seen(e.url, last=64)) for e in stack.engines]) == sent + 1
