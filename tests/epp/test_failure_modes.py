"""The EPP killed under the InferencePool's two failure modes, through a real Envoy: FailOpen
(ext_proc `failure_mode_allow`) still serves, Envoy picking the endpoint itself; FailClose refuses.
A deployment of its own: the test kills its EPP.

In FULL_DUPLEX_STREAMED mode Envoy fails open only while none of the request's body went to the
EPP: a stream to an EPP that died still takes the body before its error comes back, and is answered
500. The example's gRPC health check on the EPP cluster makes the stream fail as it opens once
Envoy knows the EPP is down; the test waits for Envoy to know it."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import STARTUP_S, wait_until
from tests.epp.stack import epp_health, epp_stack
from tests.simfleet import seen


async def test_epp_killed_fail_open_serves_and_fail_close_refuses(tmp_path: Path) -> None:
    with epp_stack(tmp_path, engines=2) as stack:
        # The engines' own model name: without the EPP nothing maps a route's name to it.
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        url = f"{stack.url}/v1/chat/completions"
        open_url = f"{stack.open_url}/v1/chat/completions"  # the same pool, its ext_proc failing open
        async with httpx.AsyncClient(timeout=STARTUP_S) as c:
            for target in (url, open_url):
                r = await c.post(target, json=body)
                assert r.status_code == 200
                assert r.headers["x-kvgate-replica"] in {"e0", "e1"}  # the EPP picked it
            stack.epp.kill()
            await wait_until(
                lambda: "failed_active_hc" in epp_health(stack.admin), STARTUP_S, "Envoy to see the EPP down"
            )
            sent = sum([len(await seen(e.url, last=64)) for e in stack.engines])
            # Envoy's workers learn of the failed check a moment after it: until then a stream still
            # opens, takes the body and fails, and the client is told (500), never left waiting.
            statuses: list[int] = []

            async def served_open() -> httpx.Response | None:
                r = await c.post(open_url, json=body)
                statuses.append(r.status_code)
                return r if r.status_code == 200 else None

            opened = await wait_until(served_open, STARTUP_S, "FailOpen to serve without the EPP", 0.05)
            assert set(statuses[:-1]) <= {500}  # before, each refused and told
            assert opened.status_code == 200, opened.text
            assert "x-kvgate-replica" not in opened.headers  # Envoy chose, without the EPP
            closed = await c.post(url, json=body)
            assert closed.status_code == 500, closed.text
            # Only the fail-open request reached an engine.
            assert sum([len(await seen(e.url, last=64)) for e in stack.engines]) == sent + 1
