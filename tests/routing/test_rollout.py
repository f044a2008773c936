"""Rollouts: header rules, weighted sticky splits, random unkeyed split, model rewrite, live weights."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, RouteConfig, load_config
from gateway.control.variant_stats import VariantStats
from gateway.path.request_record import RequestRecord
from gateway.routing.rollout import BUCKETS, Choice, Rollouts, sticky_bucket
from tests.conftest import gateway_settings

POOLS = {"stable": "m-stable", "canary": "m-canary"}


def route(stable: float = 95, canary: float = 5, salt: str = "rollout-7", **sticky: Any) -> RouteConfig:
    return RouteConfig(
        model="llama",
        rules=[
            {"match": {"headers": {"X-Canary": "1"}}, "pools": [{"name": "canary"}]},
            {
                "pools": [{"name": "stable", "weight": stable}, {"name": "canary", "weight": canary}],
                "sticky": {"salt": salt, **sticky},
            },
        ],
    )


def _pool(choice: Choice | None) -> str | None:
    return None if choice is None else choice.pool


def split(router: Rollouts, keys: range, header: str = "x-user-id") -> dict[str, str]:
    return {str(k): _pool(router.resolve("llama", {header: f"user-{k}"}, {})) for k in keys}


def test_header_rule_overrides_the_split() -> None:
    router = Rollouts([route(100, 0)], POOLS)
    assert _pool(router.resolve("llama", {"x-canary": "1"}, {})) == "canary"
    assert _pool(router.resolve("llama", {"x-canary": "0", "x-user-id": "a"}, {})) == "stable"
    assert _pool(router.resolve("m-canary", {}, {})) == "canary"  # a pool's own model name routes to it
    assert router.resolve("nope", {}, {}) is None


@pytest.mark.parametrize("canary", [5.0, 30.0, 50.0])
def test_split_over_10k_keys_matches_weights_within_2_percent(canary: float) -> None:
    router = Rollouts([route(100 - canary, canary)], POOLS)
    counts = Counter(split(router, range(10_000)).values())
    assert abs(counts["canary"] / 10_000 - canary / 100) < 0.02, counts


def test_raising_canary_weight_only_moves_users_from_stable_to_canary() -> None:
    before = split(Rollouts([route(95, 5)], POOLS), range(10_000))
    after = split(Rollouts([route(80, 20)], POOLS), range(10_000))
    moved = [k for k in before if before[k] != after[k]]
    assert moved, "a weight change must move someone"
    assert all(before[k] == "stable" and after[k] == "canary" for k in moved)
    # Unnormalized weights (not summing to 100): raising the canary still only moves stable users.
    bigger = split(Rollouts([route(95, 15)], POOLS), range(10_000))
    assert all(bigger[k] == "canary" for k in before if before[k] == "canary")


def test_sticky_assignment_is_deterministic_and_salted() -> None:
    a = split(Rollouts([route(50, 50)], POOLS), range(2000))
    b = split(Rollouts([route(50, 50)], POOLS), range(2000))  # another gateway instance, same config
    assert a == b
    other_salt = split(Rollouts([route(50, 50, salt="rollout-8")], POOLS), range(2000))
    assert sum(a[k] != other_salt[k] for k in a) > 500  # a new salt reshuffles users
    assert sticky_bucket("s", "k") == sticky_bucket("s", "k") < BUCKETS


def test_sticky_key_sources_in_order() -> None:
    router = Rollouts([route(50, 50, key="header:x-session-id|body:metadata.session_id|body:user")], POOLS)
    rule = router.routes["llama"][1]
    assert rule.sticky_key({"x-session-id": "s1"}, {"user": "u1"}) == "s1"
    assert rule.sticky_key({}, {"user": "u1", "metadata": {"session_id": "m1"}}) == "m1"
    assert rule.sticky_key({}, {"user": "u1", "metadata": "not an object"}) == "u1"
    assert rule.sticky_key({}, {"user": {"an": "object"}}) is None  # not a usable key
    assert rule.sticky_key({}, {}) is None
    # Keyed by the body's user, a user always lands in the same pool.
    picks = {_pool(router.resolve("llama", {}, {"user": "alice"})) for _ in range(50)}
    assert len(picks) == 1


def test_requests_without_key_are_split_at_random_by_weight() -> None:
    router = Rollouts([route(70, 30)], POOLS)
    counts = Counter(_pool(router.resolve("llama", {}, {})) for _ in range(10_000))
    assert abs(counts["canary"] / 10_000 - 0.30) < 0.03, counts


def test_set_weights_rollback_and_validation() -> None:
    router = Rollouts([route(50, 50)], POOLS)
    assert router.set_weights("llama", {"canary": 0}) == 1
    assert set(split(router, range(1000)).values()) == {"stable"}
    assert router.weights("llama") == {"stable": 50.0, "canary": 0.0}
    with pytest.raises(KeyError):
        router.set_weights("llama", {"nope": 1})
    with pytest.raises(KeyError):
        router.set_weights("llama", {"canary": 1}, rule_index=5)
    with pytest.raises(ValueError):
        router.set_weights("llama", {"stable": 0})  # nothing left to route to
    with pytest.raises(ValueError):
        router.set_weights("llama", {"stable": -1})
    assert router.weights("llama") == {"stable": 50.0, "canary": 0.0}


def test_bad_sticky_source_rejected_at_config_load() -> None:
    data = gateway_settings(["http://127.0.0.1:1"]).model_dump()
    data["routes"] = [{"model": "x", "rules": [{"pools": [{"name": "p"}], "sticky": {"key": "cookie:sid"}}]}]
    with pytest.raises(ConfigError, match=r"sticky\.key.*cookie:sid"):
        load_config(None, data)


def rollout_settings(stable_url: str, canary_url: str, stable: float, canary: float, **extra: Any) -> Any:
    return gateway_settings(
        [],
        pools=[
            {
                "name": "stable",
                "model": "m",
                "endpoints": [{"url": stable_url}],
                "policy": {"type": "round_robin"},
            },
            {
                "name": "canary",
                "model": "m",
                "served_model": "m-v2",
                "endpoints": [{"url": canary_url}],
                "policy": {"type": "round_robin"},
            },
        ],
        routes=[route(stable, canary).model_dump()],
        **extra,
    )


async def test_gateway_split_pool_header_and_model_rewrite(upstreams, gateway) -> None:
    s, c = await upstreams(2)
    gws = [await gateway(rollout_settings(s.url, c.url, 50, 50)) for _ in range(2)]
    seen: dict[str, set[str]] = {}
    async with httpx.AsyncClient() as client:
        for i in range(40):
            for gw in gws:  # two instances with the same config agree on every user
                r = await client.post(
                    gw.url + "/v1/completions",
                    json={"model": "llama", "prompt": "hi"},
                    headers={"x-user-id": f"user-{i}"},
                )
                assert r.status_code == 200
                seen.setdefault(f"user-{i}", set()).add(r.headers["x-kvgate-pool"])
        r = await client.post(
            gws[0].url + "/v1/completions", json={"model": "llama", "prompt": "hi"}, headers={"x-canary": "1"}
        )
        assert r.headers["x-kvgate-pool"] == "canary"
    assert all(len(pools) == 1 for pools in seen.values())
    assert {p for pools in seen.values() for p in pools} == {"stable", "canary"}
    assert {x.body["model"] for x in s.state.seen} == {"m"}
    assert {x.body["model"] for x in c.state.seen} == {"m-v2"}  # per-pool model rewrite


def test_variant_stats_window_percentiles_and_errors() -> None:
    now = [0.0]
    stats = VariantStats(window_s=60, max_samples=100, clock=lambda: now[0])

    def record(pool: str, status: int, ttft: float | None, e2e: float, **kw: Any) -> RequestRecord:
        rec = RequestRecord("r", "chat", started=0.0, model="llama", pool=pool, status=status, **kw)
        rec.first_byte_at = ttft
        rec.ended = e2e
        return rec

    for i in range(1, 101):
        stats(record("stable", 200, i / 1000, 2 * i / 1000))
    stats(record("canary", 502, None, 0.5))
    stats(record("canary", 200, 0.01, 0.02, error_code="upstream_stream_error"))
    stats(record("canary", 400, None, 0.001))
    stats(record("canary", 499, None, 0.3, client_disconnected=True))  # nobody to judge it for
    stats(RequestRecord("x", "chat", model="llama", status=404))  # never reached a pool
    snap = stats.snapshot()["llama"]
    assert snap["stable"]["ttft_ms"] == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
    assert snap["stable"]["e2e_ms"]["p50"] == 100.0
    assert snap["stable"]["window_error_rate"] == 0.0
    canary = snap["canary"]
    assert (canary["requests_total"], canary["errors_total"], canary["client_errors_total"]) == (3, 2, 1)
    assert canary["window_error_rate"] == pytest.approx(2 / 3)
    now[0] = 61.0  # the window slides; totals stay
    snap = stats.snapshot()["llama"]
    assert snap["stable"]["window_requests"] == 0 and snap["stable"]["ttft_ms"]["p50"] is None
    assert snap["stable"]["requests_total"] == 100
