"""Routing-policy plugins: found through installed entry points or "module:Class", with clear errors."""

from __future__ import annotations

import logging
import textwrap
import warnings
from pathlib import Path

import httpx
import pytest

from gateway.config import BreakerConfig, ConfigError, ScrapeConfig, load_config
from gateway.fleet.pool import Pool
from gateway.policy import API_VERSION, LoadScorer, Policy, PrefixScorer, least_loaded, rank_by
from gateway.routing.policy import PolicyLoadError, load_policy
from gateway.routing.pool_router import PoolRouter
from policies.least_load import LeastLoad
from tests.conftest import REPO, gateway_settings
from tests.policies.helpers import candidates, engine_report, replicas, request
from tests.recording_policy import Recording

EXAMPLE = REPO / "examples" / "policy_plugin"

PLUGIN_MODULE = '''
from pydantic import BaseModel, ConfigDict

from gateway.policy import Policy


class LastFirstParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    skip: int = 0


class LastFirst(Policy[LastFirstParams]):
    """Ranks the candidates in reverse order."""

    def rank(self, request, candidates):
        return list(reversed(candidates))[self.params.skip:]


class OldLastFirst(Policy):
    """The same, written against version 1 of the API."""

    Params = LastFirstParams

    async def rank(self, request, candidates):
        return list(reversed(candidates))[self.params.skip:]


class NotAPolicy:
    pass
'''


def install_plugin(root: Path, monkeypatch: pytest.MonkeyPatch, entry_points: str) -> None:
    """What `pip install` leaves behind, minus pip: a module and a dist-info with entry points,
    on a sys.path entry, where importlib.metadata finds them."""
    (root / "tmp_policies.py").write_text(PLUGIN_MODULE)
    dist = root / "tmp_policies-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tmp-policies\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    monkeypatch.syspath_prepend(str(root))


def test_installed_entry_point_is_found_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_plugin(tmp_path, monkeypatch, "[kvgate.policies]\nlast_first = tmp_policies:LastFirst\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a version-2 plugin loads without a deprecation
        policy = load_policy("last_first", {"skip": 1})
    assert policy.api_version == API_VERSION == 2
    assert policy.params.skip == 1
    reps = replicas(3)
    ranked = policy.rank(request(), candidates(reps))
    assert [c.replica.name for c in ranked] == ["r1", "r0"]
    # The built-ins are entry points of the same group.
    with pytest.raises(PolicyLoadError) as err:
        load_policy("no_such_policy")
    message = str(err.value)
    assert "unknown policy 'no_such_policy'" in message
    for name in ("last_first", "least_load", "prefix_affinity", "radix_cache_aware", "round_robin"):
        assert name in message


def test_bad_entry_points_name_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_plugin(
        tmp_path,
        monkeypatch,
        """
        [kvgate.policies]
        broken = tmp_policies_missing:Nope
        not_policy = tmp_policies:NotAPolicy
        """,
    )
    with pytest.raises(PolicyLoadError, match=r"policy 'broken': loading tmp_policies_missing:Nope failed"):
        load_policy("broken")
    with pytest.raises(PolicyLoadError, match=r"'not_policy' is not a gateway.policy.Policy subclass"):
        load_policy("not_policy")


def test_module_class_route_and_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    policy = load_policy("kvgate_header_pin:HeaderPin", {"header": "x-send-to"})
    reps = replicas(3)
    reps[0].lease(10)
    ranked = policy.rank(request(headers={"x-send-to": "r0"}), candidates(reps))
    assert ranked[0].replica.name == "r0"
    ranked = policy.rank(request(), candidates(reps))
    assert ranked[-1].replica.name == "r0"  # unpinned: fewest in flight first
    with pytest.raises(PolicyLoadError, match=r"policy 'kvgate_header_pin:HeaderPin' args\.header: "):
        load_policy("kvgate_header_pin:HeaderPin", {"header": ""})
    with pytest.raises(PolicyLoadError, match=r"args\.hedaer: Extra inputs are not permitted"):
        load_policy("kvgate_header_pin:HeaderPin", {"hedaer": "x"})
    with pytest.raises(PolicyLoadError, match=r"args\.prefill_tokens_per_s: Input should be greater than 0"):
        load_policy("prefix_affinity", {"prefill_tokens_per_s": 0})
    with pytest.raises(PolicyLoadError, match=r"cannot import 'no_such_module'"):
        load_policy("no_such_module:Policy")
    with pytest.raises(PolicyLoadError, match=r"'kvgate_header_pin' has no 'Missing'"):
        load_policy("kvgate_header_pin:Missing")


async def test_gateway_routes_with_the_example_plugin(
    upstreams, gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    ups = await upstreams(3)
    settings = gateway_settings(
        [u.url for u in ups], pool={"policy": {"type": "kvgate_header_pin:HeaderPin"}}
    )
    gw = await gateway(settings)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        for target in ("r2", "r1", "r2"):
            resp = await client.post("/v1/chat/completions", json=body, headers={"x-pin-replica": target})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-replica"] == target


async def test_version_1_plugin_warns_naming_what_to_change_and_still_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, upstreams, gateway
) -> None:
    install_plugin(tmp_path, monkeypatch, "[kvgate.policies]\nold_last_first = tmp_policies:OldLastFirst\n")
    with pytest.warns(DeprecationWarning) as caught:
        policy = load_policy("old_last_first")
    (message,) = [str(w.message) for w in caught]
    assert "'old_last_first' (tmp_policies.OldLastFirst) uses plugin API version 1" in message
    assert "`async def rank` -> `def rank`" in message
    assert "`Params = LastFirstParams` -> `class OldLastFirst(Policy[LastFirstParams])`" in message
    assert policy.api_version == 1
    # Its coroutine is run to its end on the spot: rank answers synchronously, as version 2's does.
    assert [c.replica.name for c in policy.rank(request(), candidates(replicas(3)))] == ["r2", "r1", "r0"]
    ups = await upstreams(3)
    settings = gateway_settings([u.url for u in ups], pool={"policy": {"type": "old_last_first"}})
    with pytest.warns(DeprecationWarning, match="OldLastFirst"):
        gw = await gateway(settings)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        for _ in range(3):
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-replica"] == "r2"


def test_the_default_pair_ranks_decode_by_rank_and_prefill_by_least_load() -> None:
    class NameOrder(Policy):
        def rank(self, request, candidates):
            return sorted(candidates, key=lambda c: c.replica.name, reverse=True)

    reps = replicas(4)
    reps[0].lease(5000)  # prefill r0 is busy, r1 idle
    pair = NameOrder(NameOrder.Params()).select_pair(request(), candidates(reps[:2]), candidates(reps[2:]))
    assert [c.replica.name for c in pair.decode] == ["r3", "r2"]
    assert [c.replica.name for c in pair.prefill] == ["r1", "r0"]


def test_scorers_compose_and_least_load_is_the_load_scorer() -> None:
    reps = replicas(3)
    reps[0].lease(1000)
    engine_report(reps[1], waiting=1)  # 1024 tokens by the engine's count
    offered = candidates(reps, {"r0": 2000, "r1": 1000})
    load = LoadScorer()
    assert [load(request(), c) for c in offered] == [1000, 1024, 0]
    assert [PrefixScorer()(request(2176), c) for c in offered] == [176, 1176, 2176]
    # Uncached prompt plus queued work: r0 (1176), r2 (2176), r1 (2200).
    ranked = rank_by(request(2176), offered, [(1.0, PrefixScorer()), (1.0, load)])
    assert [c.replica.name for c in ranked] == ["r0", "r2", "r1"]
    least = LeastLoad(LeastLoad.Params())
    assert least.rank(request(), offered) == least_loaded(offered, load, 1)


def _pool_router(endpoints: list[dict[str, object]], policy: dict[str, object]) -> tuple[Pool, PoolRouter]:
    pools = [{"name": "p", "model": "m", "endpoints": endpoints, "policy": policy}]
    cfg = load_config(None, {"pools": pools}).pools[0]
    pool = Pool(cfg, BreakerConfig(), ScrapeConfig())
    router = PoolRouter(pool)
    for ep in cfg.endpoints:
        pool.add_replica(ep.url, name=ep.name, role=ep.role)
    return pool, router


def test_a_decision_ranks_both_legs_and_its_policy_hears_the_end_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoints = [
        {"url": "http://127.0.0.1:1", "name": "p0", "role": "prefill"},
        {"url": "http://127.0.0.1:2", "name": "p1", "role": "prefill"},
        {"url": "http://127.0.0.1:3", "name": "d0", "role": "decode"},
    ]
    args = {"prefill_first": "p1"}
    pool, router = _pool_router(endpoints, {"type": "tests.recording_policy:Recording", "args": args})
    features = router.features({"model": "m", "prompt": "hi"}, "completions", "req-1", {})
    decision = router.route(features)
    assert [c.replica.name for c in decision.prefills] == ["p1", "p0"]  # the policy's select_pair
    assert [c.replica.name for c in decision.ranked] == ["d0"]
    recording = router.policy
    assert isinstance(recording, Recording)
    decision.sent_prefill(pool.replicas["p1"])
    decision.sent(pool.replicas["d0"])
    decision.prefill = "p1"
    assert [name for _, name in recording.routed] == ["d0"]  # a prefill leg is not the request's route
    decision.ended(200, None, 0.1, 0.2, None, 0)
    decision.ended(500, "engine_error", 0.1, 0.3, None, 0)  # settled already: nothing more is heard
    (ended,) = recording.ended
    assert (ended.replica, ended.outcome.prefill_replica, ended.outcome.attempts) == ("d0", "p1", 1)
    assert ended.outcome.ok and ended.outcome.prompt_tokens == features.prompt_tokens

    # A hook that fails is logged; nothing reaches the request.
    def fail(*args: object) -> None:
        raise ValueError("a plugin's bug")

    monkeypatch.setattr(router.policy, "on_complete", fail)
    with caplog.at_level(logging.ERROR):
        router.route(features).ended(200, None, 0.1, 0.2, None, 0)
    assert "Recording.on_complete failed for request req-1" in caplog.text


def test_a_removed_prefill_policy_is_refused_with_what_replaced_it() -> None:
    endpoints = [
        {"url": "http://127.0.0.1:1", "role": "prefill"},
        {"url": "http://127.0.0.1:2", "role": "decode"},
    ]
    pd = {"prefill_policy": {"type": "least_load"}}
    with pytest.raises(ConfigError, match=r"prefill_policy was removed.*select_pair"):
        load_config(None, {"pools": [{"name": "p", "model": "m", "endpoints": endpoints, "pd": pd}]})


def test_the_outcome_is_built_only_for_a_policy_that_hears_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _, router = _pool_router([{"url": "http://127.0.0.1:1"}], {"type": "round_robin"})
    features = router.features({"model": "m", "prompt": "hi"}, "completions", "req-1", {})
    built: list[object] = []
    monkeypatch.setattr("gateway.routing.decision.Outcome", lambda **kw: built.append(kw))
    router.route(features).ended(200, None, 0.1, 0.2, None, 0)
    assert built == []  # round_robin keeps the base class's no-op
    heard: list[object] = []
    monkeypatch.setattr(router.policy, "on_complete", lambda *args: heard.append(args))  # set on the instance
    router.route(features).ended(200, None, 0.1, 0.2, None, 0)
    assert len(built) == 1 and len(heard) == 1


def test_first_token_is_passed_only_to_a_policy_with_the_hook(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, router = _pool_router([{"url": "http://127.0.0.1:1", "name": "r0"}], {"type": "round_robin"})
    features = router.features({"model": "m", "prompt": "hi"}, "completions", "req-1", {})
    assert not router.route(features).hears_first_token  # round_robin keeps the base class's no-op

    # A hook that fails is logged, and the stream it was called from goes on; it is heard once.
    calls: list[object] = []

    def fail(*args: object) -> None:
        calls.append(args)
        raise ValueError("a plugin's bug")

    monkeypatch.setattr(router.policy, "on_first_token", fail)
    decision = router.route(features)
    assert decision.hears_first_token
    with caplog.at_level(logging.ERROR):
        decision.first_token(pool.replicas["r0"])
        decision.first_token(pool.replicas["r0"])
    assert "RoundRobin.on_first_token failed for request req-1" in caplog.text and len(calls) == 1
