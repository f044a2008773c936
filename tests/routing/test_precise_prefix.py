"""Precise prefix mode end to end: a gateway launches simulated engines with KV events on,
tokenizes through them, routes to the replica whose events say it holds the prompt, and forgets
a replica's blocks the moment the engine drops them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, load_config
from gateway.fleet.pool import Pool
from gateway.routing.kv_events import TokenBlockHasher
from gateway.routing.precise_prefix import PrecisePrefix
from tests.conftest import STARTUP_S, gateway_settings, wait_until
from tests.simfleet import sim_process

SYSTEM = "You answer questions about the tides of the North Sea, briefly and exactly. " * 40


def _chat(question: str) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }


def _sample(metrics: str, series: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(series + " "))
    return float(line.split()[-1])


async def _engine_ids(url: str, body: dict[str, object]) -> list[int]:
    async with httpx.AsyncClient() as c:
        r = await c.post(url + "/tokenize", json=body)
        r.raise_for_status()
        return r.json()["tokens"]


def _tiny_engines(tmp_path: Path, **more: object) -> dict[str, object]:
    """Two managed simulators of the tiny profile publishing KV events (`more` adds or replaces keys)."""
    return {
        "kind": "sim",
        "replicas": 2,
        "kv_events": True,
        "startup_timeout_s": 30,
        "log_dir": str(tmp_path / "logs"),
        "sim": {"profile": "tiny", "speedup": 20},
        **more,
    }


async def _managed_precise(
    gateway: Any, engines: dict[str, object], prefix: dict[str, object]
) -> tuple[Any, Pool, PrecisePrefix]:
    """A gateway launching two simulated replicas that publish KV events, in precise mode, once both
    serve and their events are heard: (gateway, pool, precise index)."""
    pool_cfg = {"endpoints": [], "engines": engines, "policy": {"type": "prefix_affinity"}, "prefix": prefix}
    gw = await gateway(gateway_settings([], pool=pool_cfg))
    pool = gw.runtime.pools["p"]
    precise = gw.runtime.routers["p"].precise
    assert precise is not None
    await wait_until(lambda: len(pool.replicas) == 2, timeout=STARTUP_S, what="two managed replicas")
    await wait_until(lambda: len(precise.subscribers) == 2, timeout=30, what="two KV event subscribers")
    return gw, pool, precise


async def test_routes_by_the_engines_events_and_forgets_what_it_drops(gateway, tmp_path) -> None:
    engines = _tiny_engines(tmp_path)
    gw, pool, precise = await _managed_precise(
        gateway, engines, {"mode": "precise", "speculative_ttl_s": 0.2}
    )

    async with httpx.AsyncClient(timeout=30) as c:
        first = await c.post(gw.url + "/v1/chat/completions", json=_chat("When is high tide at Texel?"))
        assert first.status_code == 200, first.text
        holder = first.headers["x-kvgate-replica"]
        url = pool.replicas[holder].url
        hashes = TokenBlockHasher(16, "m").hashes(
            await _engine_ids(url, _chat("When is high tide at Texel?"))
        )
        assert len(hashes) > 40

        # Confirmed by the engine's events, not only remembered from the decision: the
        # speculative entry expires after 0.2 s, the stored blocks stay.
        await wait_until(
            lambda: (
                precise.indexer.stats.stored >= len(hashes)
                and precise.index.stats()["replicas"][holder]["speculative"] == 0
            ),
            timeout=10,
            what="BlockStored events to confirm the decision",
        )
        other = next(n for n in pool.replicas if n != holder)
        assert precise.index.match(hashes, [holder, other]) == {holder: len(hashes), other: 0}

        for question in ("And at Den Helder?", "How high does the spring tide rise?", "When is low tide?"):
            r = await c.post(gw.url + "/v1/chat/completions", json=_chat(question))
            assert r.status_code == 200
            assert r.headers["x-kvgate-replica"] == holder
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40 * 16
        assert precise.tokenize_failures == 0
        metrics = (await c.get(gw.url + "/metrics")).text
        stored = _sample(metrics, 'kvgate_kv_event_blocks_total{outcome="stored",pool="p"}')
        assert stored >= len(hashes)
        assert _sample(metrics, f'kvgate_kv_event_batches_total{{pool="p",replica="{holder}"}}') > 0
        assert _sample(metrics, 'kvgate_precise_tokenize_failures_total{pool="p"}') == 0

        # The engine drops its cache (AllBlocksCleared): the gateway's view follows at once.
        flushed = await c.post(url + "/flush_cache")
        assert flushed.status_code == 200
        await wait_until(
            lambda: precise.index.match(hashes, [holder])[holder] == 0, timeout=10, what="the flush event"
        )
        metrics = (await c.get(gw.url + "/metrics")).text
        assert _sample(metrics, 'kvgate_kv_event_clears_total{pool="p"}') >= 1
        assert _sample(metrics, f'kvgate_kv_event_decode_errors_total{{pool="p",replica="{holder}"}}') == 0


async def test_batches_a_replica_lost_or_reordered_are_replayed_not_left_out(gateway, tmp_path) -> None:
    """Issue 37: gaps were counted and never asked for. A managed simulator (vLLM's replay socket)
    drops two batches and reorders two: the gateway asks for them and its index holds every block
    the engine stored, with nothing forgotten."""
    engines = _tiny_engines(tmp_path)
    gw, pool, precise = await _managed_precise(
        gateway, engines, {"mode": "precise", "speculative_ttl_s": 0.2}
    )
    async with httpx.AsyncClient(timeout=30) as c:
        first = await c.post(gw.url + "/v1/chat/completions", json=_chat("When is high tide at Texel?"))
        holder = first.headers["x-kvgate-replica"]
        url = pool.replicas[holder].url
        sub = precise.subscribers[holder]
        await wait_until(lambda: sub.stats.last_seq is not None, timeout=10, what="the holder's events")
        faults = await c.post(url + "/sim/kv_events/faults", json={"drop": 2, "reorder": 2})
        assert faults.status_code == 200, faults.text
        questions = [f"What is the tide table for day {d} of the spring tide at Texel?" for d in range(6)]
        wanted = []
        for question in questions:
            r = await c.post(gw.url + "/v1/chat/completions", json=_chat(question))
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] == holder
            wanted.append(TokenBlockHasher(16, "m").hashes(await _engine_ids(url, _chat(question))))
        state = (await c.post(url + "/sim/kv_events/faults", json={})).json()
        assert (state["dropped"], state["reordered"]) == (2, 2)  # the engine did lose and reorder them
        await wait_until(
            lambda: all(precise.index.match(h, [holder])[holder] == len(h) for h in wanted),
            timeout=20,
            what="every block the engine stored, the lost batches' included",
        )
        st = sub.stats
        assert st.replays >= 1 and st.replayed >= 2 and st.resets == 0 and st.gaps >= 2
        metrics = (await c.get(gw.url + "/metrics")).text
        assert _sample(metrics, f'kvgate_kv_event_replays_total{{pool="p",replica="{holder}"}}') >= 1
        assert _sample(metrics, f'kvgate_kv_event_resets_total{{pool="p",replica="{holder}"}}') == 0


async def test_an_engine_that_cannot_tokenize_is_routed_without_prefix_information(
    upstreams, gateway
) -> None:
    (up,) = await upstreams(1)  # a plain OpenAI-compatible server: no /tokenize
    settings = gateway_settings(
        [up.url],
        pool={
            "policy": {"type": "prefix_affinity"},
            "prefix": {"mode": "precise"},
            "endpoints": [{"url": up.url, "name": "r0", "kv_events": "tcp://127.0.0.1:9"}],
        },
    )
    gw = await gateway(settings)
    precise = gw.runtime.routers["p"].precise
    assert precise is not None
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=_chat("hello"))
    assert r.status_code == 200, r.text
    assert precise.tokenize_failures == 1
    assert precise.index.stats()["distinct_blocks"] == 0


def test_precise_mode_without_kv_events_is_a_config_error() -> None:
    data = {
        "pools": [
            {"name": "p", "model": "m", "prefix": {"mode": "precise"}, "endpoints": [{"url": "http://h:1"}]}
        ]
    }
    with pytest.raises(ConfigError, match="precise needs KV events"):
        load_config(None, data)


def _publishing_sim(**overrides: object) -> str:
    """`--kv-events-config` as an operator following vLLM's docs writes it (topic left at its default)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **overrides})


async def _kv_endpoint(url: str) -> str:
    async with httpx.AsyncClient() as c:
        return (await c.get(url + "/sim/state")).json()["kv_events_endpoint"]


async def test_an_unmanaged_engine_with_vllms_default_topic_is_heard(gateway) -> None:
    """vLLM's default topic is the empty string: `endpoints[].kv_events` given as a plain address
    subscribes to exactly that, so an engine configured by vLLM's docs is heard."""
    with sim_process("--kv-events-config", _publishing_sim(endpoint="tcp://127.0.0.1:*")) as url:
        endpoint = await _kv_endpoint(url)
        pool = {
            "policy": {"type": "prefix_affinity"},
            "prefix": {"mode": "precise"},
            "endpoints": [{"url": url, "name": "r0", "kind": "sim", "kv_events": endpoint}],
        }
        gw = await gateway(gateway_settings([url], pool=pool))
        precise = gw.runtime.routers["p"].precise
        assert precise is not None and precise.subscribers["r0"].topic == ""
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + "/v1/chat/completions", json=_chat("When is high tide at Texel?"))
            assert r.status_code == 200, r.text
        await wait_until(lambda: precise.indexer.stats.stored > 40, timeout=10, what="BlockStored events")
        assert precise.events_state("r0") == "ok"


async def test_missing_events_are_reported_and_routing_falls_back_visibly(gateway, caplog) -> None:
    """Events that never come (here: the topic differs, so ZMQ filters every message out) are
    reported once owed longer than kv_events_timeout_s, and the replica is routed by the
    approximate index: the second request for the prompt is a cache hit, not a cold guess."""
    caplog.set_level(logging.WARNING, logger="gateway.routing.precise_prefix")
    with sim_process("--kv-events-config", _publishing_sim(endpoint="tcp://127.0.0.1:*")) as url:
        endpoint = await _kv_endpoint(url)
        pool = {
            "policy": {"type": "prefix_affinity"},
            "prefix": {"mode": "precise", "kv_events_timeout_s": 0.3, "speculative_ttl_s": 0.1},
            "endpoints": [
                {
                    "url": url,
                    "name": "r0",
                    "kind": "sim",
                    "kv_events": {"endpoint": endpoint, "topic": "other"},
                }
            ],
        }
        gw = await gateway(gateway_settings([url], pool=pool))
        precise = gw.runtime.routers["p"].precise
        assert precise is not None
        async with httpx.AsyncClient(timeout=30) as c:
            assert precise.events_state("r0") == "waiting"  # nothing owed before any traffic
            first = await c.post(gw.url + "/v1/chat/completions", json=_chat("When is high tide?"))
            assert first.status_code == 200
            await wait_until(lambda: precise.events_state("r0") == "missing", timeout=10, what="missing")
            assert any("no usable KV events from replica r0" in r.getMessage() for r in caplog.records)

            second = await c.post(gw.url + "/v1/chat/completions", json=_chat("And at Den Helder?"))
            assert second.status_code == 200
            metrics = (await c.get(gw.url + "/metrics")).text
            dashboard = (await c.get(gw.url + "/dashboard/state")).json()
        assert _sample(metrics, 'kvgate_kv_events_state{pool="p",replica="r0",state="missing"}') == 1
        assert _sample(metrics, 'kvgate_precise_fallback_decisions_total{pool="p",replica="r0"}') >= 1
        decisions = 'kvgate_routing_decisions_total{policy="prefix_affinity",pool="p",reason="%s"}'
        # The second request was matched on the approximate index (the speculative entry of the
        # first had expired): a hit, where the precise index alone would have said cold.
        assert _sample(metrics, decisions % "cold") == 1 and _sample(metrics, decisions % "cache_hit") == 1
        kv = dashboard["pools"][0]["replicas"][0]["kv_events"]
        assert kv["state"] == "missing" and kv["fallback_decisions"] >= 1


async def test_a_prefix_the_gpu_evicted_is_routed_to_the_replica_holding_it_in_cpu_memory(
    gateway, tmp_path
) -> None:
    """Managed engines with a CPU tier (`kv_offload`, the simulator as vLLM's OffloadingConnector):
    the GPU events' removal leaves the prompt CPU-resident in the index, and the next request with
    that prefix goes back to its holder and is served from CPU (its engine counts external hits)."""
    engines = _tiny_engines(
        tmp_path,
        kv_offload={"size_gib": 0.25},  # 1,365 blocks of the tiny profile
        sim={"profile": "tiny", "speedup": 20, "extra_args": ["--num-gpu-blocks-override", "64"]},
    )
    # prefix_affinity with its defaults; with cpu_tier false it goes to the other replica.
    gw, pool, precise = await _managed_precise(gateway, engines, {"mode": "precise"})

    async with httpx.AsyncClient(timeout=30) as c:
        first = await c.post(gw.url + "/v1/chat/completions", json=_chat("When is high tide at Texel?"))
        assert first.status_code == 200, first.text
        holder = first.headers["x-kvgate-replica"]
        other = next(n for n in pool.replicas if n != holder)
        url = pool.replicas[holder].url
        hashes = TokenBlockHasher(16, "m").hashes(
            await _engine_ids(url, _chat("When is high tide at Texel?"))
        )
        assert 40 < len(hashes) < 64  # it fits the GPU's 64 blocks, but not beside another prompt
        await wait_until(
            lambda: precise.indexer.stats.cpu_stored >= len(hashes), timeout=10, what="the CPU tier's stores"
        )
        # Other prompts, sent to the holder's engine itself, push the prompt out of its GPU.
        for i in range(2):
            other_prompt = {"model": "m", "prompt": f"filler {i} " * 200, "max_tokens": 1}
            assert (await c.post(url + "/v1/completions", json=other_prompt)).status_code == 200
        await wait_until(
            lambda: (
                precise.index.match_tiers(hashes, [holder, other])
                == {holder: (0, len(hashes)), other: (0, 0)}
            ),
            timeout=10,
            what="the prompt evicted from the GPU and still held in CPU memory",
        )
        again = await c.post(gw.url + "/v1/chat/completions", json=_chat("And at Den Helder?"))
        assert again.status_code == 200
        assert again.headers["x-kvgate-replica"] == holder
        # All of the prefix the two questions share (the last block holds the first question's words).
        shared = (len(hashes) - 1) * 16
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared
        engine_metrics = (await c.get(url + "/metrics")).text
        series = "vllm:external_prefix_cache_hits_total"
        hits = [float(line.split()[-1]) for line in engine_metrics.splitlines() if line.startswith(series)]
        assert hits and hits[0] >= shared

        # Issue 37 item 2: the tier shows, per replica, in /metrics and on the status page: what
        # kvgate believed held on CPU beside what the engine loaded from it, once scraped again.
        def cpu_loads() -> bool:
            return (pool.replicas[holder].engine.cpu_loads_total or 0) >= 1

        await wait_until(cpu_loads, timeout=10, what="a scrape that has the engine's CPU loads")
        metrics = (await c.get(gw.url + "/metrics")).text
        who = f'pool="p",replica="{holder}"'
        believed = _sample(metrics, f'kvgate_prefix_matched_tokens_total{{medium="cpu",{who}}}')
        assert believed >= shared - 16
        replica = f'kind="sim",{{}}{who},role="mixed"'
        assert (
            _sample(metrics, "kvgate_replica_engine_cached_tokens{" + replica.format('medium="cpu",') + "}")
            >= shared
        )
        assert _sample(metrics, "kvgate_replica_engine_cpu_loads{" + replica.format("") + "}") >= 1
        state = (await c.get(gw.url + "/dashboard/state")).json()
        (row,) = [r for p in state["pools"] for r in p["replicas"] if r["name"] == holder]
        assert row["prefix"]["cpu_matched_tokens"] == believed
        assert row["prefix"]["engine_cpu_hit_tokens"] >= shared and row["prefix"]["engine_cpu_loads"] >= 1
