"""LoRA adapters as routing facts: declared, discovered, loaded on demand, preferred where resident.

Simulators play vLLM: `--lora-modules`, `/v1/models` with `parent`, `/v1/load_lora_adapter` under
VLLM_ALLOW_RUNTIME_LORA_UPDATING, and swap counts in `/sim/state`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from gateway.config import BreakerConfig, ConfigError, ScrapeConfig, load_config
from gateway.fleet.pool import Pool
from gateway.routing.pool_router import PoolRouter
from tests.conftest import gateway_settings, wait_until
from tests.simfleet import sim_fleet, sim_process

CHAT = [{"role": "user", "content": "hello there"}]


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_declared_and_discovered_adapters(gateway) -> None:  # type: ignore[no-untyped-def]
    args = ("--enable-lora", "--lora-modules", "sql=/adapters/sql", "fr=/adapters/fr")
    with sim_process(*args) as url:
        # Without discovery a declared adapter is assumed on every replica: `ghost` is not, and the
        # engine's own 404 reaches the client in the gateway's shape, its message intact.
        lora: dict[str, Any] = {"adapters": [{"name": "sql"}, {"name": "ghost"}]}
        gw = await gateway(gateway_settings([url], pool={"lora": lora}))
        async with _client(gw.url) as client:
            assert (
                await client.chat.completions.create(model="sql", messages=CHAT, max_tokens=2)
            ).model == "sql"
            with pytest.raises(openai.NotFoundError) as exc:
                await client.chat.completions.create(model="ghost", messages=CHAT, max_tokens=2)
            assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]
            assert exc.value.body["message"] == "The model `ghost` does not exist."  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):  # `fr` is on the engine, but nobody said so
                await client.chat.completions.create(model="fr", messages=CHAT, max_tokens=2)
        # With discovery the engine's own list is learned: `fr` becomes routable, `ghost` is known absent.
        lora |= {"discover": True, "discover_interval_s": 0.1}
        gw = await gateway(gateway_settings([url], pool={"lora": lora}))
        lora_facts = gw.runtime.routers["p"].lora
        await wait_until(lambda: lora_facts.knows("fr"), what="the replica's adapters to be read")
        async with _client(gw.url) as client:
            listed = {m.id: m.model_dump().get("parent") for m in (await client.models.list()).data}
            assert listed == {"m": None, "sql": "m", "ghost": "m", "fr": "m"}
            assert (
                await client.chat.completions.create(model="fr", messages=CHAT, max_tokens=2)
            ).model == "fr"
            with pytest.raises(openai.InternalServerError) as exc:  # no replica serves it
                await client.chat.completions.create(model="ghost", messages=CHAT, max_tokens=2)
            assert exc.value.status_code == 503


async def test_adapters_loaded_on_demand_once_per_replica(gateway, upstreams, tmp_path) -> None:  # type: ignore[no-untyped-def]
    engines = {
        "kind": "sim",
        "startup_timeout_s": 30,
        "log_dir": str(tmp_path / "logs"),
        "sim": {"profile": "tiny", "speedup": 20},
        "lora": {
            "modules": [{"name": "sql", "path": "/adapters/sql"}],
            "runtime_updates": True,
            "max_loras": 2,
        },
    }
    lora = {
        "adapters": [{"name": "de", "path": "/adapters/de"}, {"name": "it", "path": "/adapters/it"}],
        "load_on_demand": True,
    }
    gw = await gateway(gateway_settings([], pool={"endpoints": [], "engines": engines, "lora": lora}))
    pool = gw.runtime.pools["p"]
    facts = gw.runtime.routers["p"].lora
    await wait_until(lambda: pool.has_healthy(), timeout=30, what="the managed replica")
    async with _client(gw.url) as client:
        # Launched with --lora-modules sql: served without a load.
        assert (await client.chat.completions.create(model="sql", messages=CHAT, max_tokens=2)).model == "sql"
        assert facts.loads == 0
        assert (await client.chat.completions.create(model="de", messages=CHAT, max_tokens=2)).model == "de"
        assert facts.loads == 1
        # Concurrent requests for a new adapter share one load.
        answers = await asyncio.gather(
            *(client.chat.completions.create(model="it", messages=CHAT, max_tokens=2) for _ in range(4))
        )
        assert {a.model for a in answers} == {"it"} and facts.loads == 2
    (replica,) = pool.replicas.values()
    async with httpx.AsyncClient() as c:
        engine_models = {m["id"] for m in (await c.get(replica.url + "/v1/models")).json()["data"]}
    assert {"sql", "de", "it"} <= engine_models

    # An engine without the dynamic LoRA endpoint: the load fails, the request is refused, and the
    # gateway keeps serving the base model.
    (up,) = await upstreams(1)
    gw = await gateway(gateway_settings([up.url], pool={"lora": lora}))
    async with _client(gw.url) as client:
        with pytest.raises(openai.InternalServerError) as exc:
            await client.chat.completions.create(model="de", messages=CHAT, max_tokens=2)
        assert exc.value.status_code == 503
        assert (await client.chat.completions.create(model="m", messages=CHAT)).choices
    assert gw.runtime.routers["p"].lora.load_failures == 1
    assert [s.path for s in up.state.seen] == ["/v1/chat/completions"]  # the refused one never reached it


async def test_each_adapter_stays_where_it_is_resident(gateway) -> None:  # type: ignore[no-untyped-def]
    args = ("--enable-lora", "--lora-modules", "a=/adapters/a", "b=/adapters/b", "--max-loras", "1")
    with sim_fleet(*args, replicas=2) as fleet:
        urls = fleet.urls
        lora = {"adapters": [{"name": "a"}, {"name": "b"}], "slots_per_replica": 1}
        gw = await gateway(gateway_settings(urls, pool={"lora": lora, "policy": {"type": "prefix_affinity"}}))
        placed: dict[str, set[str]] = {"a": set(), "b": set()}
        async with httpx.AsyncClient(base_url=gw.url) as c:
            # Pairs of each: round robin would put every adapter on both replicas.
            for i, model in enumerate("aabbaabbaabb"):
                body = {"model": model, "prompt": f"question {i} about rakes", "max_tokens": 2}
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["model"] == model
                placed[model].add(r.headers["x-kvgate-replica"])
            states = [(await c.get(u + "/sim/state")).json()["lora"] for u in urls]
    assert len(placed["a"]) == len(placed["b"]) == 1 and placed["a"] != placed["b"]
    assert [s["swaps"] for s in states] == [1, 1]  # each replica swapped its one adapter in, once


def _router(**lora: Any) -> PoolRouter:
    cfg = load_config(
        None,
        {
            "pools": [
                {
                    "name": "p",
                    "model": "m",
                    "endpoints": [
                        {"url": "http://127.0.0.1:1", "name": "r0"},
                        {"url": "http://127.0.0.1:2", "name": "r1"},
                    ],
                    "lora": {"adapters": [{"name": "a"}, {"name": "b"}], **lora},
                }
            ]
        },
    ).pools[0]
    pool = Pool(cfg, BreakerConfig(), ScrapeConfig())
    router = PoolRouter(pool)
    for ep in cfg.endpoints:
        pool.add_replica(ep.url, name=ep.name)
    return router


def test_prefixes_are_hashed_per_adapter() -> None:
    router = _router()
    body = {"messages": [{"role": "system", "content": "You sell garden tools. " * 40}]}
    hashes = {m: router.features({**body, "model": m}, "chat", "r", {}).block_hashes for m in ("m", "a", "b")}
    assert all(hashes.values())
    assert not set(hashes["a"]) & set(hashes["b"]) and not set(hashes["a"]) & set(hashes["m"])
    assert router.features({**body, "model": "a"}, "chat", "r", {}).block_hashes == hashes["a"]


def test_a_hot_adapter_spills_like_a_hot_prefix() -> None:
    router = _router()
    features = router.features({"model": "a", "prompt": "short question"}, "completions", "r", {})
    router.learn(features, router.pool.replicas["r0"])  # `a` is resident on r0
    assert router.rank(features)[0].replica.name == "r0"
    # r0 now runs many requests: waiting there costs more than swapping `a` in on r1.
    leases = [router.pool.replicas["r0"].lease(10) for _ in range(40)]
    features = router.features({"model": "a", "prompt": "another question"}, "completions", "r2", {})
    assert router.rank(features)[0].replica.name == "r1"
    for lease in leases:
        lease.release()
    router.learn(features, router.pool.replicas["r1"])
    assert router.lora.resident == {"r0": {"a": None}, "r1": {"a": None}}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            {"routes": [{"model": "x", "rules": [{"pools": [{"name": "p", "adapter": "zz"}]}]}]},
            "declares no adapter",
        ),
        ({"routes": [{"model": "x", "rules": [{"pools": [{"name": "p"}, {"name": "p"}]}]}]}, "once per rule"),
        ({"pool": {"lora": {"adapters": [{"name": "a"}], "load_on_demand": True}}}, "needs a path"),
        ({"pool": {"lora": {"adapters": [{"name": "m"}]}}}, "also pool model names"),
        (
            {
                "pool": {
                    "endpoints": [],
                    "engines": {"kind": "vllm", "lora": {}},
                    "lora": {"adapters": [{"name": "a", "path": "/a"}], "load_on_demand": True},
                }
            },
            "runtime_updates",
        ),
    ],
)
def test_lora_config_mistakes_are_named(change: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        gateway_settings(["http://127.0.0.1:1"], **change)
