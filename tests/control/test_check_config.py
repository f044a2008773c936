"""`kvgate check-config` resolves what `kvgate serve` resolves (policies and their args, prefill
policy, canonicalize rules, tokenizer, managed command lines) and fails the same way: exit 2 and
one line. Settings from the environment take lists as JSON or comma-separated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from tests.test_lifecycle import kvgate

ENDPOINTS = [{"url": "http://127.0.0.1:9"}]


def config(tmp_path: Path, **pool: Any) -> str:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({"pools": [{"name": "p", "model": "m", "endpoints": ENDPOINTS, **pool}]}))
    return str(path)


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        ({"policy": {"type": "prefix_afinity"}}, "pools.0 (p).policy: unknown policy 'prefix_afinity'"),
        (
            {"policy": {"type": "prefix_affinity", "args": {"prefill_tokens_per_sec": 1}}},
            "args.prefill_tokens_per_sec: Extra inputs are not permitted",
        ),
        ({"policy": {"type": "no_such_module:Policy"}}, "cannot import 'no_such_module'"),
        ({"pd": {"prefill_policy": {"type": "least_load"}}}, "prefill_policy was removed"),
        ({"tokenizer": "/no/such/tokenizer.json"}, "pools.0 (p).tokenizer: tokenizer '/no/such"),
        ({"tokenizer": "builtin:bpe"}, "unknown; built-in: builtin:cl100k, builtin:words"),
        (
            {"canonicalize": {"enabled": True, "rules": [{"name": "id", "pattern": "(user"}]}},
            "canonicalize rule 'id': invalid regex",
        ),
        ({"canonicalize": {"builtin_rules": ["isodate"]}}, "unknown built-in canonicalize rule 'isodate'"),
        (
            {"endpoints": [], "engines": {"kind": "sglang", "kv_cache_memory_bytes": 1 << 30}},
            "pools.0 (p).engines: kv_cache_memory_bytes is not supported by SGLang",
        ),
        (
            {"endpoints": [], "engines": {"kind": "sim", "sim": {"extra_args": ["--replicas", "2"]}}},
            "--replicas is not supported under the launcher",
        ),
        (
            {
                "prefix": {"mode": "precise"},
                "endpoints": [{"url": "http://h:1", "kv_events": "tcp://*:5557"}],
            },
            "is the engine's bind address",
        ),
    ],
)
def test_what_serve_would_refuse_check_config_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pool: dict[str, Any], expected: str
) -> None:
    path = config(tmp_path, **pool)
    assert main(["check-config", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_a_good_config_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, policy={"type": "prefix_affinity", "args": {"prefill_tokens_per_s": 20000}})
    assert main(["check-config", path]) == 0
    assert "ok (1 pools" in capsys.readouterr().out


def test_lists_from_the_environment_are_json_or_comma_separated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.config import load_config

    monkeypatch.setenv("KVGATE_SERVER__API_KEYS", "key-a, key-b")
    monkeypatch.setenv("KVGATE_RETRY__RETRY_STATUSES", "[429, 503]")
    settings = load_config(config(tmp_path))
    assert settings.server.api_keys == ["key-a", "key-b"] and settings.retry.retry_statuses == [429, 503]
    monkeypatch.setenv("KVGATE_RETRY__RETRY_STATUSES", "429,nope")
    assert main(["check-config", config(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "retry.retry_statuses.1" in err, err


def test_serve_refuses_an_unknown_policy_in_one_line_as_check_config_does(tmp_path: Path) -> None:
    out = kvgate("serve", "--config", config(tmp_path, policy={"type": "prefix_afinity"}))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown policy 'prefix_afinity'" in lines[0]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (  # the canary.yaml: the control plane on its first engine's port
            {"control": {"admin_key": "k", "port": 9001}, "endpoints": ["http://127.0.0.1:9001"]},
            "control.port 9001 is also pools.0.endpoints.0 (http://127.0.0.1:9001)'s port",
        ),
        (
            {"server": {"host": "0.0.0.0", "port": 8000}, "endpoints": ["http://localhost:8000"]},
            "server.port 8000 is also pools.0.endpoints.0",
        ),
        (
            {"control": {"admin_key": "k", "port": 8000}, "endpoints": ["http://127.0.0.1:9"]},
            "server.port 8000 is also control.port's port",
        ),
        (
            {"engines": {"kind": "sim", "replicas": 2, "base_port": 7999}, "endpoints": []},
            "server.port 8000 is also pools.0.engines.base_port's port",
        ),
    ],
)
def test_port_collisions_are_refused(tmp_path: Path, settings: dict[str, Any], expected: str) -> None:
    pool: dict[str, Any] = {"name": "p", "model": "m"}
    if settings.get("endpoints"):
        pool["endpoints"] = [{"url": url} for url in settings["endpoints"]]
    if "engines" in settings:
        pool["engines"] = settings["engines"]
    doc = {k: v for k, v in settings.items() if k in ("server", "control")} | {"pools": [pool]}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = kvgate("check-config", str(path))
    assert out.returncode == 2 and expected in out.stderr, out.stderr


def test_ports_apart_or_on_other_hosts_pass(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    pools = [{"name": "p", "model": "m", "endpoints": [{"url": "http://vllm-0:8000"}]}]
    doc = {"server": {"host": "0.0.0.0"}, "control": {"admin_key": "k", "port": 9001}, "pools": pools}
    path.write_text(yaml.safe_dump(doc))
    out = kvgate("check-config", str(path))
    assert out.returncode == 0, out.stderr


def test_an_engine_not_installed_here_is_a_warning(tmp_path: Path) -> None:
    """The config may be checked away from the GPU host: a missing engine command warns (the
    launcher refuses to start it, in the same words), it does not fail the check."""
    pool = {"name": "p", "model": "m", "engines": {"kind": "vllm", "env": {"PATH": str(tmp_path)}}}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({"pools": [pool]}))
    warning = (
        "kvgate: warning: pools.0 (p).engines: `vllm` not found on PATH: set engines.command or install vLLM"
    )
    for command in (["check-config", str(path)], ["launch", str(path), "--dry-run"]):
        out = kvgate(*command)
        assert out.returncode == 0, out.stderr
        assert out.stderr.splitlines() == [warning]
    assert f"{path}: ok (1 pools, 0 routes)" in kvgate("check-config", str(path)).stdout
    # A fleet that can start here: no warning.
    pool["engines"] = {"kind": "sim"}
    path.write_text(yaml.safe_dump({"pools": [pool]}))
    assert kvgate("check-config", str(path)).stderr == ""
