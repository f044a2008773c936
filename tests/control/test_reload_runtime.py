"""A reload keeps what was changed at run time where the file did not change: a serving `kvgate
serve` process, its weights and replicas changed on the admin API, reloaded by the API and by
SIGHUP with the file unchanged and then changed."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import STARTUP_S, free_port, wait_until
from tests.control.test_admin import AUTH, file_config, post, serve, write_config


async def test_runtime_weights_and_replicas_survive_a_reload_of_what_the_file_did_not_change(
    upstreams, tmp_path: Path
) -> None:
    s, c, extra = await upstreams(3)
    port, control_port = free_port(), free_port()
    path = tmp_path / "kvgate.yaml"
    data = file_config(s.url, c.url, (50, 50), port, control_port)
    write_config(path, data)
    proc = serve(path)
    gw, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control_port}"
    try:
        async with httpx.AsyncClient(timeout=10) as client:

            async def weights() -> dict[str, Any] | None:
                assert proc.poll() is None, "kvgate serve exited"
                try:
                    r = await client.get(admin + "/admin/routes", headers=AUTH)
                except httpx.TransportError:
                    return None
                return {p["name"]: p["weight"] for p in r.json()["routes"]["llama"][0]["pools"]}

            async def audit() -> list[str]:
                r = await client.get(admin + "/admin/audit", headers=AUTH)
                return [e["what"] for e in r.json()["changes"]]

            async def reload() -> list[str]:
                r = await client.post(admin + "/admin/reload", headers=AUTH)
                assert r.status_code == 200, r.text
                return r.json()["changes"]

            assert await wait_until(weights, STARTUP_S, "kvgate serve") == {"stable": 50.0, "canary": 50.0}
            # The canary rolled back, and a replica added to the stable pool, at run time.
            r = await client.put(
                admin + "/admin/routes/llama/weights", json={"weights": {"canary": 0}}, headers=AUTH
            )
            assert r.status_code == 200, r.text
            r = await client.post(
                admin + "/admin/pools/stable/replicas", json={"url": extra.url, "name": "added"}, headers=AUTH
            )
            assert r.status_code == 201, r.text

            # The file unchanged: a reload changes nothing, and says so.
            assert await reload() == []
            assert await weights() == {"stable": 50.0, "canary": 0.0}
            assert {(await post(client, gw)).headers["x-kvgate-pool"] for _ in range(20)} == {"stable"}
            r = await client.get(admin + "/admin/pools", headers=AUTH)
            assert set(r.json()["pools"]["stable"]["replicas"]) == {"stable-0", "added"}
            os.kill(proc.pid, signal.SIGHUP)  # the same through the signal

            async def sighup_reloaded() -> bool:
                return (await audit()).count("config reloaded: no changes") == 2

            await wait_until(sighup_reloaded, STARTUP_S, "the SIGHUP reload", 0.05)
            assert await weights() == {"stable": 50.0, "canary": 0.0}

            # The route changed in the file: its weights are the file's, each moved weight named.
            data["routes"][0]["rules"][0]["pools"][1]["weight"] = 20
            write_config(path, data)
            expected = [
                "routes replaced",
                "route llama rule 0: canary weight 0 (set at run time) -> 20 (the file's)",
            ]
            assert await reload() == expected
            assert await weights() == {"stable": 50.0, "canary": 20.0}
            assert (await audit())[-1] == "config reloaded: " + "; ".join(expected)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()[-2000:]
