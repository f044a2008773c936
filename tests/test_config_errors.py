"""A config that cannot be served is refused in one line that names the key and says what is wrong:
a YAML error gives the parser's reason and where; no `<root>:` nor `Value error,` from pydantic,
no union member's name in the key; an unknown key is named as such, with the setting it resembles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError, load_config
from tests.test_lifecycle import kvgate

ENDPOINT = {"url": "http://127.0.0.1:9"}


def refusal(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return str(err.value)


def test_invalid_yaml_says_why_and_where(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("server:\n  port: 8000\n bad: [\n")
    out = kvgate("check-config", str(path))
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"kvgate: config error: {path}: invalid YAML at line 3, column 2: expected <block end>, but found "
        "'<block mapping start>' (while parsing a block mapping at line 1, column 1)"
    ]


def test_a_tab_for_indentation_is_named(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("server:\n\tport: 1\n")
    with pytest.raises(ConfigError, match=r"line 2, column 1: found character '\\t' that cannot start"):
        load_config(path)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (  # a check across keys: its reason names them
            {"server": {"admin_key": "a"}, "control": {"admin_key": "b"}, "pools": [], "routes": []},
            "server.admin_key (deprecated) and control.admin_key differ: keep control's",
        ),
        (  # a model's own check: the key where it failed, then the reason
            {"pools": [{"name": "p", "model": "m"}]},
            "pools.0: needs `engines` (managed), `endpoints` (unmanaged) or `discovery`",
        ),
        (  # a field's validator
            {"pools": [{"name": "p", "model": "m", "endpoints": [{"url": "ftp://h:1"}]}]},
            "pools.0.endpoints.0.url: must start with http:// or https://",
        ),
        (  # a union: the key, without pydantic's member names, and what each member expected
            {"server": {"ready": "some"}, "pools": [{"name": "p", "model": "m", "endpoints": [ENDPOINT]}]},
            "server.ready: Input should be 'any' or 'all'; or Input should be a valid list",
        ),
        (
            {"server": {"prot": 8001}},
            "server.prot: not a setting (did you mean port?)",
        ),
        (
            {"tenants": [{"name": "t", "api_key": "k", "max_priority": "urgent"}]},
            "tenants.0 (t).max_priority: 'urgent' is not one of scheduler.classes",
        ),
        (
            {"pools": [{"name": "p", "model": "m", "endpoints": [ENDPOINT]}] * 2},
            "pools: each pool needs a name of its own: ['p', 'p']",
        ),
    ],
)
def test_validation_errors_name_the_key_and_the_reason(
    tmp_path: Path, doc: dict[str, Any], expected: str
) -> None:
    message = refusal(tmp_path, doc)
    assert message.startswith(expected), message
    assert "<root>" not in message and "Value error" not in message and "literal[" not in message


def test_several_wrong_keys_are_counted(tmp_path: Path) -> None:
    message = refusal(tmp_path, {"server": {"port": -1, "max_n": 0}, "retry": {"max_attempts": 0}})
    assert message == "server.port: Input should be greater than or equal to 0 (and 2 more)"


@pytest.mark.parametrize("weight", [1e308, 5e-324, 1_000_001, float("inf"), float("nan"), -1])
def test_route_weights_are_bounded(tmp_path: Path, weight: float) -> None:
    """Two weights of 1e308 summed to infinity and sent every request to the second pool; 5e-324
    was a positive weight that no request could land on."""
    pools = [{"name": n, "model": "m", "endpoints": [ENDPOINT]} for n in ("stable", "canary")]
    split = [{"name": "stable", "weight": weight}, {"name": "canary", "weight": weight}]
    message = refusal(tmp_path, {"pools": pools, "routes": [{"model": "x", "rules": [{"pools": split}]}]})
    assert message.startswith("routes.0.rules.0.pools.0.weight: "), message
    if weight > 0 and weight != float("inf"):
        assert "a weight is 0 (out of the split) or from 0.001 to 1,000,000, not " in message


def test_weights_at_the_bounds_pass(tmp_path: Path) -> None:
    pools = [{"name": n, "model": "m", "endpoints": [ENDPOINT]} for n in ("a", "b", "c")]
    split = [{"name": "a", "weight": 0}, {"name": "b", "weight": 0.001}, {"name": "c", "weight": 1_000_000}]
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({"pools": pools, "routes": [{"model": "x", "rules": [{"pools": split}]}]}))
    assert [p.weight for p in load_config(path).routes[0].rules[0].pools] == [0, 0.001, 1_000_000]
