"""Routing-policy plugins: found through installed entry points or "module:Class", with clear errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest

from gateway.routing.policy import PolicyLoadError, load_policy
from tests.conftest import REPO, gateway_settings
from tests.policies.helpers import candidates, replicas, request

EXAMPLE = REPO / "examples" / "policy_plugin"

PLUGIN_MODULE = '''
from pydantic import BaseModel, ConfigDict

from gateway.routing.policy import Policy


class LastFirstParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    skip: int = 0


class LastFirst(Policy):
    """Ranks the candidates in reverse order."""

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
    policy = load_policy("last_first", {"skip": 1})
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
