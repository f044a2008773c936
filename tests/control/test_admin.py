"""Admin API end to end, on the control listener: auth, live weights and rollback, endpoints, drain,
reload (the API and SIGHUP), rollout status."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.control.rollout_cli import main as rollout_main
from tests.conftest import PYTHON, REPO, free_port, gateway_settings, subprocess_env, wait_until
from tests.routing.test_rollout import rollout_settings

KEY = "admin-secret"
AUTH = {"authorization": f"Bearer {KEY}"}


async def post(client: httpx.AsyncClient, url: str, **headers: str) -> httpx.Response:
    return await client.post(
        url + "/v1/completions", json={"model": "llama", "prompt": "hi"}, headers=headers
    )


async def test_auth_missing_wrong_and_disabled(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    on = await gateway(gateway_settings([up.url], control={"admin_key": KEY}))
    off = await gateway(gateway_settings([up.url]))
    assert on.control is not None and on.control.port not in (0, on.port)
    assert off.control is None  # no admin key: no control listener at all
    async with httpx.AsyncClient(base_url=on.control.url) as c:
        r = await c.get("/admin/routes")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_admin_key"
        r = await c.get("/admin/routes", headers={"authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await c.put("/admin/routes/x/weights", json={"weights": {"a": 1}})
        assert r.status_code == 401  # writes too, before anything is looked at
        r = await c.get("/admin/pools", headers=AUTH)
        assert r.status_code == 200
        assert set(r.json()["pools"]["p"]["replicas"]) == {"r0"}
        for gw in (on, off):  # the data plane does not answer it, key or not
            r = await c.get(gw.url + "/admin/pools", headers=AUTH)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_weight_change_rollback_stats_and_status_cli(upstreams, gateway, capsys) -> None:
    s, c = await upstreams(2)
    gw = await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}))
    async with httpx.AsyncClient() as client:
        pools = {
            (await post(client, gw.url, **{"x-user-id": f"u{i}"})).headers["x-kvgate-pool"] for i in range(30)
        }
        assert pools == {"stable", "canary"}
        # Rollback: canary weight 0, effective for the very next request.
        r = await client.put(
            gw.control_url + "/admin/routes/llama/weights", json={"weights": {"canary": 0}}, headers=AUTH
        )
        assert r.status_code == 200
        assert r.json() == {
            "model": "llama",
            "rule": 1,
            "weights": {"stable": 50.0, "canary": 0.0},
            "previous": {"stable": 50.0, "canary": 50.0},
        }
        pools = {
            (await post(client, gw.url, **{"x-user-id": f"u{i}"})).headers["x-kvgate-pool"] for i in range(30)
        }
        assert pools == {"stable"}
        for bad, code in (
            ({"weights": {"nope": 1}}, 404),
            ({"weights": {"stable": 0}}, 400),
            ({"weights": {"stable": "x"}}, 400),
            ({"weights": {}}, 400),
        ):
            r = await client.put(gw.control_url + "/admin/routes/llama/weights", json=bad, headers=AUTH)
            assert r.status_code == code, (bad, r.text)
            assert "error" in r.json()
        r = await client.put(
            gw.control_url + "/admin/routes/nope/weights", json={"weights": {"a": 1}}, headers=AUTH
        )
        assert r.status_code == 404
        await post(client, gw.url, **{"x-canary": "1", "x-test-mode": "status:500"})
        audit = (await client.get(gw.control_url + "/admin/audit", headers=AUTH)).json()["changes"]
        assert len(audit) == 1
        assert "route llama rule 1 weights" in audit[0]["what"] and "admin key" in audit[0]["who"]
        doc = (await client.get(gw.control_url + "/admin/rollouts", headers=AUTH)).json()
    route = doc["routes"]["llama"]
    assert route["split_rule"] == 1 and len(route["rules"]) == 2
    variants = route["variants"]
    assert variants["stable"]["share"] == 1.0 and variants["canary"]["share"] == 0.0
    stable, canary = variants["stable"]["stats"], variants["canary"]["stats"]
    assert stable["requests_total"] + canary["requests_total"] == 61
    assert canary["errors_total"] == 1 and stable["errors_total"] == 0
    assert stable["ttft_ms"]["p50"] is not None and stable["e2e_ms"]["p95"] >= stable["e2e_ms"]["p50"]

    argv = ["--admin", gw.control_url, "--admin-key", KEY]
    assert await asyncio.to_thread(rollout_main, ["weights", *argv, "llama", "canary=25", "stable=75"]) == 0
    assert gw.runtime.rollouts.weights("llama") == {"stable": 75.0, "canary": 25.0}
    capsys.readouterr()
    assert await asyncio.to_thread(rollout_main, ["status", *argv]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("  stable", "  canary"))
    }
    assert rows["stable"][1:3] == ["75", "75.0%"] and rows["canary"][1:3] == ["25", "25.0%"]
    assert int(rows["stable"][3]) == stable["requests_total"] and rows["canary"][4] == "1"
    assert "  rule 0: match x-canary=1, -> canary\n" in out
    assert "  rule 1: split stable 75 / canary 25, sticky header:x-user-id|body:user salt 'rollout-7'" in out
    assert (
        await asyncio.to_thread(rollout_main, ["status", "--admin", gw.control_url, "--admin-key", "bad"])
        == 1
    )
    assert "HTTP 401" in capsys.readouterr().err
    # Pointed at the data plane (where /admin used to be), it says where to look.
    assert await asyncio.to_thread(rollout_main, ["status", "--admin", gw.url, "--admin-key", KEY]) == 1
    assert "HTTP 404" in (err := capsys.readouterr().err) and "control.host:control.port" in err


async def test_weights_out_of_bounds_are_refused_by_the_api_and_the_cli(upstreams, gateway, capsys) -> None:
    """1e308 for both pools overflowed the split (every request to the second); 5e-324 was accepted."""
    s, c = await upstreams(2)
    gw = await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}))
    url = gw.control_url + "/admin/routes/llama/weights"
    async with httpx.AsyncClient() as client:
        for weights in ({"stable": 1e308, "canary": 1e308}, {"canary": 5e-324}, {"canary": 1_000_001}):
            r = await client.put(url, json={"weights": weights}, headers=AUTH)
            assert r.status_code == 400, (weights, r.text)
            error = r.json()["error"]
            assert error["code"] == "invalid_weights" and error["param"].startswith("weights.")
            assert "a weight is 0 (out of the split) or from 0.001 to 1,000,000, not " in error["message"]
            assert "Value error" not in error["message"]
        r = await client.put(url, json={"weights": {"canary": 1_000_000, "stable": 0.001}}, headers=AUTH)
        assert r.status_code == 200, r.text
    assert gw.runtime.rollouts.weights("llama") == {"stable": 0.001, "canary": 1_000_000.0}
    argv = ["--admin", gw.control_url, "--admin-key", KEY, "llama"]
    for bad in ("canary=1e308", "canary=5e-324", "canary=inf", "canary=nan"):
        assert await asyncio.to_thread(rollout_main, ["weights", *argv, bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvgate rollout: {bad}: a weight is 0 (out of the split) or from 0.001"), err
    assert gw.runtime.rollouts.weights("llama") == {"stable": 0.001, "canary": 1_000_000.0}


async def test_a_json_body_needs_no_content_type(upstreams, gateway) -> None:
    """curl's `-d` says form-urlencoded, and some clients send no type at all: the body is JSON
    either way; a body that is not JSON is named so."""
    s, c = await upstreams(2)
    gw = await gateway(rollout_settings(s.url, c.url, 50, 50, control={"admin_key": KEY}))
    url = gw.control_url + "/admin/routes/llama/weights"
    body = b'{"weights": {"canary": 0}}'
    async with httpx.AsyncClient() as client:
        form = {**AUTH, "content-type": "application/x-www-form-urlencoded"}
        r = await client.put(url, content=body, headers=form)
        assert r.status_code == 200, r.text
        assert r.json()["weights"] == {"stable": 50.0, "canary": 0.0}
        r = await client.put(url, content=b'{"weights": {"canary": 5}}', headers=AUTH)  # no type at all
        assert r.status_code == 200 and r.json()["weights"]["canary"] == 5.0
        r = await client.put(url, content=b"weights=canary:0", headers=form)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_add_and_remove_endpoint(upstreams, gateway) -> None:
    u0, u1 = await upstreams(2)
    gw = await gateway(gateway_settings([u0.url], control={"admin_key": KEY}))
    async with httpx.AsyncClient() as c:
        url = gw.control_url + "/admin/pools/p/replicas"
        r = await c.post(url, json={"url": u1.url, "name": "extra", "kind": "openai"}, headers=AUTH)
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "extra" and r.json()["available"]
        assert (await c.post(url, json={"url": u1.url}, headers=AUTH)).status_code == 409
        assert (await c.post(url, json={"url": "ftp://x"}, headers=AUTH)).status_code == 400
        assert (
            await c.post(gw.control_url + "/admin/pools/nope/replicas", json={"url": u1.url}, headers=AUTH)
        ).status_code == 404
        for _ in range(6):
            assert (
                await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"})
            ).status_code == 200
        assert len(u1.state.seen) == 3  # round robin now includes it
        r = await c.delete(url + "/extra", headers=AUTH)
        assert r.status_code == 200 and r.json()["removed"] == "extra"
        assert (await c.delete(url + "/extra", headers=AUTH)).status_code == 404
        for _ in range(4):
            assert (
                await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"})
            ).status_code == 200
        assert len(u1.state.seen) == 3
        whats = [
            e["what"] for e in (await c.get(gw.control_url + "/admin/audit", headers=AUTH)).json()["changes"]
        ]
    assert whats == [f"pool p: added replica extra at {u1.url}", "pool p: removed replica extra"]


async def test_drain_finishes_inflight_and_admits_no_new(upstreams, gateway) -> None:
    u0, u1 = await upstreams(2)
    gw = await gateway(gateway_settings([u0.url, u1.url], control={"admin_key": KEY}))
    r0 = gw.runtime.pools["p"].replicas["r0"]
    async with httpx.AsyncClient(timeout=10) as c:
        body = {"model": "m", "prompt": "x"}
        slow = asyncio.create_task(
            c.post(gw.url + "/v1/completions", json=body, headers={"x-test-mode": "stall:1"})
        )
        await wait_until(lambda: r0.inflight_requests == 1, what="the slow request on r0")
        r = await c.post(gw.control_url + "/admin/pools/p/replicas/r0/drain", headers=AUTH)
        assert r.status_code == 200 and r.json()["draining"] and r.json()["inflight_requests"] == 1
        for _ in range(5):
            resp = await c.post(gw.url + "/v1/completions", json=body)
            assert resp.headers["x-kvgate-replica"] == "r1"
        done = await slow
        assert done.status_code == 200 and done.headers["x-kvgate-replica"] == "r0"
        assert len(u0.state.seen) == 1
        await c.post(gw.control_url + "/admin/pools/p/replicas/r1/drain", headers=AUTH)
        resp = await c.post(gw.url + "/v1/completions", json=body)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_healthy_replica"
        r = await c.post(gw.control_url + "/admin/pools/p/replicas/r0/undrain", headers=AUTH)
        assert r.status_code == 200 and not r.json()["draining"]
        resp = await c.post(gw.url + "/v1/completions", json=body)
        assert resp.headers["x-kvgate-replica"] == "r0"
        assert (
            await c.post(gw.control_url + "/admin/pools/p/replicas/zz/drain", headers=AUTH)
        ).status_code == 404


def write_config(path: Path, data: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(data))


def file_config(
    stable: str, canary: str, weights: tuple[float, float], port: int = 0, control_port: int = 0
) -> dict[str, Any]:
    return {
        "server": {"port": port, "grace_period_s": 1, "access_log": False},
        "control": {"port": control_port, "admin_key": KEY},
        "health": {"enabled": False},
        "pools": [
            {
                "name": "stable",
                "model": "m",
                "endpoints": [{"url": stable}],
                "policy": {"type": "round_robin"},
            },
            {
                "name": "canary",
                "model": "m",
                "endpoints": [{"url": canary}],
                "policy": {"type": "round_robin"},
            },
        ],
        "routes": [
            {
                "model": "llama",
                "rules": [
                    {
                        "pools": [
                            {"name": "stable", "weight": weights[0]},
                            {"name": "canary", "weight": weights[1]},
                        ]
                    }
                ],
            }
        ],
    }


def serve(path: Path) -> subprocess.Popen[bytes]:
    """`kvgate serve --config path` in a process of its own, its log on a pipe."""
    return subprocess.Popen(
        [PYTHON, "-m", "gateway", "serve", "--config", str(path)],
        env=subprocess_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def reloadable(gateway, path: Path, data: dict[str, Any]):  # type: ignore[no-untyped-def]
    """A gateway started from `data`, written to `path`, which its reloads re-read."""
    from gateway.config import load_config

    write_config(path, data)
    gw = await gateway(load_config(path))
    gw.runtime.reloader.config_path = str(path)
    return gw


async def test_reload_valid_invalid_and_inflight_survives(upstreams, gateway, tmp_path) -> None:
    s, c, extra = await upstreams(3)
    path = tmp_path / "kvgate.yaml"
    data = file_config(s.url, c.url, (100, 0))
    gw = await reloadable(gateway, path, data)
    async with httpx.AsyncClient(timeout=10) as client:
        # A request in flight on the canary replica that the reload removes still completes.
        slow = asyncio.create_task(post(client, gw.url, **{"x-test-mode": "stall:1"}))
        stable = gw.runtime.pools["stable"].replicas["stable-0"]
        await wait_until(lambda: stable.inflight_requests == 1, what="the slow request")
        data["pools"][0]["endpoints"] = [{"url": extra.url, "name": "new"}]
        data["routes"][0]["rules"][0]["pools"][1]["weight"] = 100
        data["routes"][0]["rules"][0]["pools"][0]["weight"] = 0
        write_config(path, data)
        r = await client.post(gw.control_url + "/admin/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["changes"] == [
            "pool stable: removed replica stable-0",
            f"pool stable: added replica new at {extra.url}",
            "routes replaced",
            "route llama rule 0: stable weight 100 -> 0 (the file's)",
            "route llama rule 0: canary weight 0 -> 100 (the file's)",
        ]
        assert (await post(client, gw.url)).headers["x-kvgate-pool"] == "canary"
        assert (await slow).status_code == 200
        assert set(gw.runtime.pools["stable"].replicas) == {"new"}

        good = yaml.safe_load(path.read_text())
        for change, named in (
            (lambda d: d["server"].update(max_body_bytes=1000), "server.max_body_bytes"),
            (lambda d: d["pools"][1].update(policy={"type": "least_load"}), "pools.canary.policy"),
            (lambda d: (d["pools"].pop(), d["routes"][0]["rules"][0]["pools"].pop()), "pools (names"),
        ):
            bad = copy.deepcopy(good)
            change(bad)
            write_config(path, bad)
            r = await client.post(gw.control_url + "/admin/reload", headers=AUTH)
            assert r.status_code == 409 and r.json()["error"]["code"] == "reload_rejected"
            assert "cannot change without a restart" in r.json()["error"]["message"]
            assert named in r.json()["error"]["message"]
        path.write_text("pools: [unclosed")
        r = await client.post(gw.control_url + "/admin/reload", headers=AUTH)
        assert r.status_code == 409 and "invalid YAML" in r.json()["error"]["message"]
        # Nothing of a rejected reload was applied.
        assert gw.runtime.rollouts.weights("llama") == {"stable": 0.0, "canary": 100.0}
        assert gw.runtime.settings.server.max_body_bytes != 1000


async def test_reload_swaps_a_routes_model_rewrite_with_its_rules(upstreams, gateway, tmp_path) -> None:
    s, c = await upstreams(2)
    path = tmp_path / "kvgate.yaml"
    data = file_config(s.url, c.url, (100, 0))
    gw = await reloadable(gateway, path, data)
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await post(client, gw.url)).json()["model"] == "llama"  # the engines' `m`, renamed
        data["routes"][0]["rewrite_model"] = False
        data["routes"].append({"model": "plain", "rules": [{"pools": [{"name": "stable"}]}]})
        write_config(path, data)
        r = await client.post(gw.control_url + "/admin/reload", headers=AUTH)
        assert r.status_code == 200 and r.json()["changes"] == ["routes replaced"], r.text
        assert (await post(client, gw.url)).json()["model"] == "m"
        body = {"model": "plain", "prompt": "hi"}
        assert (await client.post(gw.url + "/v1/completions", json=body)).json()["model"] == "plain"


async def test_sighup_reloads_a_serving_process(upstreams, tmp_path) -> None:
    s, c = await upstreams(2)
    port = free_port()
    path = tmp_path / "kvgate.yaml"
    control_port = free_port()
    data = file_config(s.url, c.url, (100, 0), port, control_port)
    write_config(path, data)
    proc = serve(path)
    url = f"http://127.0.0.1:{control_port}"
    try:
        async with httpx.AsyncClient(timeout=5) as client:

            async def weights() -> dict[str, Any] | None:
                try:
                    r = await client.get(url + "/admin/routes", headers=AUTH)
                except httpx.TransportError:
                    return None
                return {p["name"]: p["weight"] for p in r.json()["routes"]["llama"][0]["pools"]}

            async def started() -> dict[str, Any] | None:
                assert proc.poll() is None, "kvgate serve exited"
                return await weights()

            assert await wait_until(started, 30, "kvgate serve", 0.05) == {"stable": 100.0, "canary": 0.0}
            data["routes"][0]["rules"][0]["pools"][1]["weight"] = 10
            write_config(path, data)
            os.kill(proc.pid, signal.SIGHUP)

            async def reloaded() -> bool:
                return await weights() == {"stable": 100.0, "canary": 10.0}

            await wait_until(reloaded, 10, "the SIGHUP reload", 0.05)
            assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"config reloaded" in err
    # It said where its control plane is, and kept SIGTERM for itself (uvicorn did not take it).
    assert f"kvgate control plane on {url} ".encode() in err
    assert b"stop signal: draining" in err and b"kvgate stopped" in err


@pytest.mark.parametrize("argv", [["weights", "llama", "bad"], ["weights", "llama", "=3"]])
def test_rollout_cli_rejects_bad_weight_args(argv: list[str], capsys) -> None:
    assert rollout_main([argv[0], "--admin", "http://127.0.0.1:1", *argv[1:]]) == 2
    assert "POOL=WEIGHT" in capsys.readouterr().err
