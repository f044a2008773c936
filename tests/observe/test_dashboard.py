"""The status page: its JSON state, its security, and the page rendered by headless Chromium.

The browser tests need Debian's `chromium` (`apt-get update && apt-get install -y chromium`);
without it they skip and say so.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from gateway.config import Settings
from gateway.server import RunningGateway
from tests.browser import chromium, needs_chromium
from tests.conftest import STARTUP_S, gateway_settings, wait_until
from tests.simfleet import launched_sims
from tests.upstream_app import Upstream

MakeUpstreams = Callable[[int], Awaitable[list[Upstream]]]
MakeGateway = Callable[[Settings], Awaitable[RunningGateway]]

ADMIN_KEY = "adm-9c1e-secret"
CLIENT_KEY = "sk-client-77"
TENANT_KEY = "sk-tenant-55"
MARKER = "walrus-41d2-unique-prompt-marker"


def settings(urls: list[str]) -> Settings:
    return gateway_settings(
        urls,
        server={"api_keys": [CLIENT_KEY]},
        control={"admin_key": ADMIN_KEY},
        tenants=[{"name": "tenant-acme", "api_key": TENANT_KEY}],
        routes=[{"model": "chat", "rules": [{"pools": [{"name": "p", "weight": 100}]}]}],
    )


async def test_state_is_live_and_keeps_secrets(upstreams: MakeUpstreams, gateway: MakeGateway) -> None:
    ups = await upstreams(3)
    gw = await gateway(settings([u.url for u in ups[:2]]))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        body = {"model": "chat", "messages": [{"role": "user", "content": MARKER}]}
        auth = {"authorization": f"Bearer {TENANT_KEY}"}
        assert (await client.post("/v1/chat/completions", json=body, headers=auth)).status_code == 200
        assert (await client.get("/dashboard/state")).status_code == 401
        wrong = {"authorization": f"Bearer {CLIENT_KEY}"}  # a client key is not the admin key
        resp = await client.get("/dashboard/state", headers=wrong)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_admin_key"
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        resp = await client.get("/dashboard/state", headers=admin)
        assert resp.status_code == 200 and resp.headers["cache-control"] == "no-store"
        state = resp.json()
        assert state["totals"]["replicas"] == 2 and state["totals"]["healthy"] == 2
        assert state["totals"]["requests"] == 1
        (pool,) = state["pools"]
        assert [r["name"] for r in pool["replicas"]] == ["r0", "r1"]
        assert pool["prompt_tokens"] > 0 and pool["hit_ratio"] == 0.0 and pool["queue_depth"] >= 0
        assert state["routes"][0]["rules"][0]["pools"] == [{"name": "p", "weight": 100.0, "share": 1.0}]
        for secret in (ADMIN_KEY, CLIENT_KEY, TENANT_KEY, "tenant-acme", MARKER, "127.0.0.1", "http"):
            assert secret not in resp.text, secret

        gw.runtime.pools["p"].add_replica(ups[2].url, name="r2")
        state = (await client.get("/dashboard/state", headers=admin)).json()
        assert state["totals"]["replicas"] == 3


async def test_routed_goes_on_when_a_launched_replica_restarts(gateway: MakeGateway, tmp_path: Path) -> None:
    """A killed engine comes back as a new replica of the same name: its ROUTED column (and
    `kvgate_replica_requests_total`) goes on from what it had counted, not from 0."""
    gw = await gateway(gateway_settings([], pool={"endpoints": [], "engines": launched_sims(tmp_path, 1)}))
    pool = gw.runtime.pools["p"]
    await wait_until(lambda: "p-0" in pool.replicas, timeout=STARTUP_S, what="the launched replica")
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}

    async def routed(client: httpx.AsyncClient) -> tuple[int, float]:
        (replica,) = (await client.get("/dashboard/state")).json()["pools"][0]["replicas"]
        metrics = (await client.get("/metrics")).text
        total = re.search(r'kvgate_replica_requests_total\{[^}]*replica="p-0"[^}]*\} (\S+)', metrics)
        assert total is not None
        return replica["total_requests"], float(total.group(1))

    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for _ in range(3):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert await routed(client) == (3, 3.0)
        first = pool.replicas["p-0"]
        (status,) = gw.runtime.fleet.launchers[0].status().values()
        assert status.pid is not None
        os.kill(status.pid, signal.SIGKILL)
        await wait_until(
            lambda: pool.replicas.get("p-0") not in (None, first), timeout=STARTUP_S, what="the restart"
        )
        await wait_until(lambda: pool.replicas["p-0"].healthy, timeout=STARTUP_S, what="it healthy")
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert await routed(client) == (4, 4.0)


async def test_state_is_open_without_admin_key(upstreams: MakeUpstreams, gateway: MakeGateway) -> None:
    ups = await upstreams(1)
    gw = await gateway(gateway_settings([ups[0].url]))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        resp = await client.get("/dashboard/state")
    assert resp.status_code == 200 and resp.json()["totals"]["replicas"] == 1


async def test_page_is_self_contained(upstreams: MakeUpstreams, gateway: MakeGateway) -> None:
    ups = await upstreams(1)
    gw = await gateway(settings([ups[0].url]))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        resp = await client.get("/dashboard")  # the shell holds no data, so it needs no key
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in resp.headers["content-security-policy"]
    assert resp.headers["referrer-policy"] == "no-referrer"
    html = resp.text
    assert not re.search(r"https?://", html), "no external resources"
    assert "<script src" not in html and "<link" not in html
    assert 'id="replica-count"' in html


def replica_count(dom: str) -> str:
    match = re.search(r'id="replica-count">([^<]*)<', dom)
    assert match, dom[:2000]
    return match.group(1)


@needs_chromium
async def test_renders_in_chromium(upstreams: MakeUpstreams, gateway: MakeGateway, tmp_path: Path) -> None:
    import matplotlib.image

    ups = await upstreams(3)
    gw = await gateway(settings([u.url for u in ups[:2]]))
    page = f"{gw.url}/dashboard?key={ADMIN_KEY}"

    dom = await chromium(tmp_path, page, "--dump-dom")
    assert replica_count(dom) == "2"
    assert 'data-replica="r0"' in dom and 'data-replica="r1"' in dom and 'class="live"' in dom
    assert ADMIN_KEY not in dom.split("<script>")[0]  # the key is not rendered into the page
    # The figures are explained: a legend under each pool, the same text as the headers' tooltips.
    assert '<dl class="legend dim"><dt>hit rate</dt>' in dom and 'title="the prompt tokens of those' in dom

    shot = tmp_path / "dashboard.png"
    await chromium(tmp_path, page, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (800, 1280)
    colors = {tuple(p) for p in pixels[::8, ::8].reshape(-1, pixels.shape[2]).round(2).tolist()}
    assert len(colors) > 10, "screenshot is blank"

    gw.runtime.pools["p"].add_replica(ups[2].url, name="r2")  # the page shows the fleet as it is now
    dom = await chromium(tmp_path, page, "--dump-dom")
    assert replica_count(dom) == "3" and 'data-replica="r2"' in dom

    dom = await chromium(tmp_path, f"{gw.url}/dashboard", "--dump-dom")  # no key: asks for one
    assert replica_count(dom) != "3" and "admin key needed" in dom
    assert re.search(r'id="login" style="display: block;"', dom)
