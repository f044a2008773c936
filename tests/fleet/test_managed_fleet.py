"""A gateway that launches its own simulated fleet: replicas join when ready, a killed one is
restarted and re-registered while traffic goes on, and nothing is left behind at shutdown."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx

from tests.conftest import STARTUP_S, gateway_settings, wait_until
from tests.simfleet import launched_sims


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state in /proc says it is gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_killed_replica_restarts_rejoins_and_no_request_fails(gateway, tmp_path):
    engines = launched_sims(tmp_path, 3)
    settings = gateway_settings(
        [], pool={"endpoints": [], "engines": engines, "policy": {"type": "round_robin"}}
    )
    gw = await gateway(settings)
    pool = gw.runtime.pools["p"]
    await wait_until(lambda: len(pool.replicas) == 3, timeout=STARTUP_S, what="three managed replicas")
    launcher = gw.runtime.fleet.launchers[0]
    pids = {name: st.pid for name, st in launcher.status().items()}
    assert all(pid and _alive(pid) for pid in pids.values())

    statuses: list[int] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            while not stop.is_set():
                r = await c.post(
                    gw.url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2}
                )
                statuses.append(r.status_code)

    clients = [asyncio.create_task(traffic()) for _ in range(4)]
    await wait_until(lambda: len(statuses) >= 20, timeout=20, what="traffic to flow")
    victim = "p-1"
    os.kill(pids[victim], signal.SIGKILL)
    await wait_until(lambda: victim not in pool.replicas, timeout=10, what="the dead replica to leave")
    await wait_until(lambda: victim in pool.replicas, timeout=STARTUP_S, what="the restarted replica back")
    served_before = pool.replicas[victim].total_requests
    await wait_until(
        lambda: pool.replicas[victim].total_requests > served_before, timeout=10, what="it to serve"
    )
    stop.set()
    await asyncio.gather(*clients)
    assert launcher.status()[victim].restarts == 1
    assert statuses and set(statuses) == {200}, f"failed requests: {[s for s in statuses if s != 200]}"

    new_pids = [st.pid for st in launcher.status().values()]
    await gw.stop()
    assert not any(_alive(pid) for pid in [*pids.values(), *new_pids] if pid)


async def test_replicas_launched_on_one_gpu_join_with_a_shared_device(gateway, tmp_path):
    """gpu_ids that put two simulators on GPU 0 and one on GPU 1: the two join the pool as one
    device (load-aware policies weigh them together), the third as a device of its own; an
    unmanaged endpoint takes the device its config names."""
    engines = {
        "kind": "sim",
        "replicas": 3,
        "gpu_ids": [[0], [0], [1]],
        "kv_cache_memory_bytes": 64 * 1024 * 1024,  # the tiny profile has no room to halve its memory
        "startup_timeout_s": STARTUP_S,
        "log_dir": str(tmp_path / "logs"),
        "sim": {"profile": "tiny", "speedup": 20},
    }
    settings = gateway_settings(
        [],
        pool={
            "endpoints": [{"url": "http://127.0.0.1:9", "name": "ext", "device": "gpu:7"}],
            "engines": engines,
        },
    )
    gw = await gateway(settings)
    pool = gw.runtime.pools["p"]
    await wait_until(
        lambda: len(pool.replicas) == 4, timeout=STARTUP_S, what="three managed replicas and one endpoint"
    )
    assert {name: r.device for name, r in pool.replicas.items()} == {
        "p-0": "gpu:0",
        "p-1": "gpu:0",
        "p-2": None,
        "ext": "gpu:7",
    }


async def test_a_launched_pd_pool_hands_off_through_the_side_channel_it_set(gateway, tmp_path):
    """The launcher gives each vLLM-speaking prefill replica its side channel
    (VLLM_NIXL_SIDE_CHANNEL_HOST) and the gateway holds prefill answers to it: the host the engine
    names for its KV is the one set, so hand-offs go through (and one naming another would not)."""
    engines = {
        "kind": "sim",
        "replicas": 2,
        "roles": {"prefill": 1, "decode": 1},
        "startup_timeout_s": STARTUP_S,
        "log_dir": str(tmp_path / "logs"),
        "sim": {"profile": "tiny", "speedup": 20},
    }
    pool_cfg = {"endpoints": [], "engines": engines, "pd": {"min_uncached_tokens": 64}}
    gw = await gateway(gateway_settings([], pool=pool_cfg))
    pool = gw.runtime.pools["p"]
    await wait_until(
        lambda: len(pool.replicas) == 2, timeout=STARTUP_S, what="the prefill and decode replicas"
    )
    (prefill,) = [r for r in pool.replicas.values() if r.role == "prefill"]
    assert prefill.kv_side_channel_host == "127.0.0.1"
    prompt = "Summarize the following text. " + "The quick brown fox jumps over the lazy dog. " * 80
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(gw.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        metrics = (await c.get(gw.url + "/metrics")).text
    assert 'kvgate_pd_requests_total{path="handoff",pool="p"} 1.0' in metrics
