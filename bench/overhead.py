"""Gateway overhead, measured side by side with direct access to the same upstream.

Three measurements in one run, against an instant upstream (bench/echo_upstream.py) so
that every extra microsecond is the gateway's:
  (a) sequential non-streaming tiny requests: latency, gateway vs direct, interleaved;
  (b) streaming first-chunk latency over keep-alive, gateway vs direct, interleaved;
  (c) C concurrent clients for D seconds: throughput, and the gateway process's CPU time
      per request (from /proc), which is what the gateway costs whatever the machine.
And what naming the client's model in answers costs: (a) and (b) again through a route alias
whose answers are renamed, against the same alias with `rewrite_model: false`, interleaved;
and the rewrite's own time per body and per streamed chunk, in this process.
The client is aiohttp on uvloop (an httpx client saturates a core near 900 requests/s,
so it would measure itself). `--transport both` puts one gateway per upstream transport
(`upstream.transport`: http1, aiohttp) in front of the same upstream and interleaves all of
them, so the transports are compared side by side in one run.
`--variant NAME=PYTHON` (repeated) runs one gateway per interpreter, each its own install of kvgate:
interpreted against compiled (mypyc) modules, side by side.
`--server both` does the same for the data plane's HTTP server (`server.impl`: httptools, aiohttp),
and `--peers sglang-router` adds SGLang's Rust router (`pip install -e ".[bench-peers]"`) in front of
the same upstream, with a table of kvgate's figures over the router's.
`--no-request-id-echo` starts the upstream without echoing X-Request-Id, as SGLang's: the gateway
then opens a connection per request (answers on reused connections must carry the request's id).
Run: `python -m bench.overhead [--quick] [--server httptools|aiohttp|both]
[--transport http1|aiohttp|both] [--peers sglang-router] [--no-request-id-echo]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import yaml

from bench import echo_upstream
from bench.procs import HOST, Child, free_port_range, python_module

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
STREAM_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
).encode()
HEADERS = {"Content-Type": "application/json"}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Pair:
    name: str
    direct_ms: dict[str, float]
    gateway_ms: dict[str, float]

    @property
    def added_ms(self) -> dict[str, float]:
        return {k: self.gateway_ms[k] - self.direct_ms[k] for k in self.direct_ms}


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": pct(values, 0.5), "p95": pct(values, 0.95), "p99": pct(values, 0.99)}


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, first_chunk: bool) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=HEADERS) as resp:
        if first_chunk:
            await resp.content.readany()
            elapsed = time.perf_counter() - t0
            await resp.read()
            return elapsed
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
        return time.perf_counter() - t0


async def sequential(
    direct: str,
    gateways: dict[str, str],
    n: int,
    body: bytes,
    first_chunk: bool,
    name: str,
    bodies: dict[str, bytes] | None = None,
) -> list[Pair]:
    """One Pair per gateway; all sides interleaved, the direct samples shared. `bodies`: what a
    gateway side sends when it differs from `body` (the rename pairs)."""
    sides = {"direct": direct, **gateways}
    send = {side: (bodies or {}).get(side, body) for side in sides}
    lat: dict[str, list[float]] = {side: [] for side in sides}
    connector = aiohttp.TCPConnector(limit=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):  # warm the keep-alive connections and every process
            for side, url in sides.items():
                await _one(session, url, send[side], first_chunk)
        # Interleaved so every side sees the same machine state (other load, CPU frequency), and in
        # an order rotated each time: the side that follows another gateway meets that process's
        # work after its answer (a two-core machine showed 0.1 ms at p50 between two equal sides).
        order = list(sides.items())
        for i in range(n):
            for side, url in order[i % len(order) :] + order[: i % len(order)]:
                lat[side].append(await _one(session, url, send[side], first_chunk))
    ms = {k: summary([v * 1e3 for v in vals]) for k, vals in lat.items()}
    return [Pair(f"{name} [{label}]", ms["direct"], ms[label]) for label in gateways]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


async def concurrent(url: str, clients: int, duration_s: float, pid: int | None) -> dict[str, float]:
    done = 0
    errors = 0
    lat: list[float] = []
    stop_at = time.perf_counter() + duration_s
    connector = aiohttp.TCPConnector(limit=clients)

    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal done, errors
            while time.perf_counter() < stop_at:
                try:
                    lat.append(await _one(session, url, BODY, False))
                    done += 1
                except (aiohttp.ClientError, RuntimeError):
                    errors += 1

        cpu0 = cpu_seconds(pid) if pid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
        cpu = (cpu_seconds(pid) - cpu0) if pid else float("nan")
    out = {"requests": done, "errors": errors, "elapsed_s": elapsed, **summary([v * 1e3 for v in lat])}
    if pid:
        out["cpu_s"] = cpu
    return out


def gateway_config(upstream: str, port: int, server: str, transport: str) -> dict[str, object]:
    return {
        "server": {"host": HOST, "port": port, "impl": server, "access_log": False, "log_level": "warning"},
        "upstream": {"transport": transport},
        "scheduler": {"enabled": True},
        "pools": [
            {"name": "p", "model": "m", "policy": {"type": "round_robin"}, "endpoints": [{"url": upstream}]}
        ],
        # The rename pairs: the same alias, answers renamed or not.
        "routes": [
            {"model": "alias", "rules": [{"pools": [{"name": "p"}]}]},
            {"model": "alias-raw", "rules": [{"pools": [{"name": "p"}]}], "rewrite_model": False},
        ],
    }


def _aliased(body: bytes, model: str) -> bytes:
    return body.replace(b'"model": "m"', f'"model": "{model}"'.encode())


def rewrite_cost(n: int = 20000) -> dict[str, float]:
    """Microseconds per call of the rename on a whole body and per chunk of a stream, in this process."""
    from gateway.path.model_names import ModelRename
    from gateway.path.sse_events import EventStream

    rename = ModelRename(["m"], "alias")
    body = echo_upstream.COMPLETION
    chunk = echo_upstream.CHUNK

    def per_call(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    plain, renamed = EventStream(None), EventStream(rename)
    return {
        "body_rename_us": per_call(lambda: rename.apply(body)),
        "chunk_events_us": per_call(lambda: plain.feed(chunk)),
        "chunk_events_renamed_us": per_call(lambda: renamed.feed(chunk)),
    }


def pair_rows(pairs: list[Pair], what: str, first: str, second: str) -> list[str]:
    lines = [
        f"| {what} | {first} p50 / p95 / p99 (ms) | {second} p50 / p95 / p99 (ms) | added p50 / p99 (ms) |",
        "| --- | --- | --- | --- |",
    ]
    for p in pairs:
        d, g, a = p.direct_ms, p.gateway_ms, p.added_ms
        lines.append(
            f"| {p.name} | {d['p50']:.3f} / {d['p95']:.3f} / {d['p99']:.3f} | "
            f"{g['p50']:.3f} / {g['p95']:.3f} / {g['p99']:.3f} | {a['p50']:.3f} / {a['p99']:.3f} |"
        )
    return lines


def table(pairs: list[Pair], conc: dict[str, dict[str, float]]) -> str:
    lines = pair_rows(pairs, "measurement", "direct", "gateway")
    lines += [
        "",
        "| concurrent clients | requests/s | p50 / p99 (ms, median of rounds) | errors | CPU per request |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for name, c in conc.items():
        cpu = c.get("gateway_cpu_us_per_request")
        cpu_text = f"{cpu:.0f} us" if cpu is not None else "-"
        lines.append(
            f"| {name} | {c['rps']:.0f} | {c['p50']:.2f} / {c['p99']:.2f} | {c['errors']:.0f} | {cpu_text} |"
        )
    return "\n".join(lines)


SGLANG_ROUTER = "sglang-router"
SGLANG_ROUTER_INSTALL = 'pip install -e ".[bench-peers]"  (sglang-router==0.3.2)'


def sglang_router_argv(upstream: str, port: int) -> list[str]:
    """sglang-router (Rust, in one process) in front of the same upstream, round robin as kvgate is."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise SystemExit(
            f"--peers {SGLANG_ROUTER} needs the router installed: {SGLANG_ROUTER_INSTALL}"
        ) from None
    return python_module(
        "sglang_router.launch_router",
        *("--host", HOST, "--port", str(port), "--worker-urls", upstream),
        *("--policy", "round_robin", "--log-level", "error"),
    )


def gateway_sides(args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """The kvgate configurations to run, as (label, HTTP server, upstream transport, interpreter)."""
    servers = ["httptools", "aiohttp"] if args.server == "both" else [args.server]
    transports = ["http1", "aiohttp"] if args.transport == "both" else [args.transport]
    variants = [tuple(v.split("=", 1)) for v in args.variant] or [("", sys.executable)]
    sides = []
    for variant, python in variants:
        for server in servers:
            for transport in transports:
                parts = (
                    [variant] * bool(variant)
                    + [f"{server} server"] * (len(servers) > 1)
                    + [f"{transport} client"] * (len(transports) > 1)
                )
                label = f"kvgate [{', '.join(parts)}]" if parts else "kvgate"
                sides.append((label, server, transport, python))
    return sides


def echo_flag(args: argparse.Namespace) -> list[str]:
    # An upstream that echoes X-Request-Id (vLLM as the launcher starts it) gets kept connections;
    # one that does not (SGLang) gets a connection per request: `--no-request-id-echo` measures that.
    return [] if args.no_request_id_echo else ["--enable-request-id-headers"]


def variant(value: str) -> str:
    name, sep, python = value.partition("=")
    if not (name and sep and python):
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PYTHON")
    return value


def pinned(argv: list[str], core: int | None) -> list[str]:
    return argv if core is None else ["taskset", "-c", str(core), *argv]


def pin_plan(processes: int) -> list[int]:
    """`--pin`: a core of its own for each of `processes` (the upstream, each proxy), the rest
    for this process (the clients); a router pinned to one core runs one worker thread (Rust's
    available parallelism follows the affinity), as kvgate's event loop is one thread."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < processes + 1 or shutil.which("taskset") is None:
        raise SystemExit(f"--pin needs taskset and {processes + 1} cores; this process has {len(cores)}")
    os.sched_setaffinity(0, cores[processes:])
    return cores[:processes]


async def run(args: argparse.Namespace) -> dict[str, object]:
    sides = gateway_sides(args)
    peers = list(args.peers)
    base = free_port_range(1 + len(sides) + len(peers))
    upstream_url = f"http://{HOST}:{base}"
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-overhead-"))
    processes = 1 + len(sides) + len(peers)
    cores: list[int | None] = list(pin_plan(processes)) if args.pin else [None] * processes
    upstream = Child(
        "upstream",
        pinned(python_module("bench.echo_upstream", "--port", str(base), *echo_flag(args)), cores.pop(0)),
        workdir / "up.log",
    )
    # label -> (base URL, readiness path, process)
    proxies: dict[str, tuple[str, str, Child]] = {}
    port = base
    for i, (label, server, transport, python) in enumerate(sides):
        port += 1
        cfg = workdir / f"gateway-{i}-{server}-{transport}.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(upstream_url, port, server, transport)))
        # A named variant runs its interpreter's installed kvgate (-P: not this checkout's sources,
        # found from the working directory first).
        serve = [python, *["-P"] * bool(args.variant), "-m", "gateway", "serve", "--config", str(cfg)]
        argv = pinned(serve, cores.pop(0))
        log_path = workdir / f"gateway-{i}-{server}-{transport}.log"
        proxies[label] = (f"http://{HOST}:{port}", "/ready", Child(label, argv, log_path))
    for peer in peers:
        port += 1
        argv = pinned(sglang_router_argv(upstream_url, port), cores.pop(0))
        proxies[peer] = (f"http://{HOST}:{port}", "/readiness", Child(peer, argv, workdir / f"{peer}.log"))
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        stack.enter_context(upstream.start())
        for _, _, child in proxies.values():
            stack.enter_context(child.start())
        upstream.wait_ready([upstream_url + "/health"], 30)
        for url, ready, child in proxies.values():
            child.wait_ready([url + ready], 60)
        path = "/v1/chat/completions"
        urls = {label: url + path for label, (url, _, _) in proxies.items()}
        pairs = [
            *await sequential(upstream_url + path, urls, args.n, BODY, False, "(a) sequential"),
            *await sequential(upstream_url + path, urls, args.n, STREAM_BODY, True, "(b) stream first chunk"),
        ]
        # The rename pairs, on the first gateway: the same alias, renamed against not.
        gw = urls[sides[0][0]]
        raw_body, raw_stream = _aliased(BODY, "alias-raw"), _aliased(STREAM_BODY, "alias-raw")
        renamed_body = {"renamed": _aliased(BODY, "alias")}
        renamed_stream = {"renamed": _aliased(STREAM_BODY, "alias")}
        renames = (
            []
            if args.no_rename
            else [
                *await sequential(gw, {"renamed": gw}, args.n, raw_body, False, "(a) alias", renamed_body),
                *await sequential(
                    gw, {"renamed": gw}, args.n, raw_stream, True, "(b) alias chunk", renamed_stream
                ),
            ]
        )
        targets: dict[str, tuple[str, int | None]] = {"direct": (upstream_url + path, None)}
        for label, (url, _, child) in proxies.items():
            assert child.proc is not None
            targets[label] = (url + path, child.proc.pid)
        rounds: dict[str, list[dict[str, float]]] = {label: [] for label in targets}
        # Rounds alternate the sides, so a change in the machine's load lands on all of them.
        for _ in range(args.rounds):
            for label, (url, pid) in targets.items():
                rounds[label].append(await concurrent(url, args.clients, args.duration, pid))
        conc = {f"{label} x{args.clients}": merge_rounds(r) for label, r in rounds.items()}
    cost = rewrite_cost()
    load = f"load average (1 min) {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    if args.pin:
        load += "; upstream and each proxy pinned to a core of its own"
    text = table(pairs, conc) + "\n\n" + peer_ratios(pairs, conc, peers)
    if renames:
        text += "\n\n" + rename_table(renames, cost)
    return {
        "pairs": [{**asdict(p), "added_ms": p.added_ms} for p in pairs],
        "concurrent": conc,
        "rename_pairs": [{**asdict(p), "added_ms": p.added_ms} for p in renames],
        "rewrite_cost_us": cost,
        "load": load,
        "table": text + f"\n\n{load}",
    }


def merge_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Rounds of the concurrent measurement as one: counts and CPU add up; latency percentiles are
    the median of the rounds' own."""
    total = {key: sum(r[key] for r in rounds) for key in ("requests", "errors", "elapsed_s")}
    total["rps"] = total["requests"] / total["elapsed_s"]
    for key in ("p50", "p95", "p99"):
        total[key] = pct([r[key] for r in rounds], 0.5)
    if "cpu_s" in rounds[0]:
        total["cpu_s"] = sum(r["cpu_s"] for r in rounds)
        total["gateway_cpu_us_per_request"] = total["cpu_s"] / max(total["requests"], 1) * 1e6
    return total


def peer_ratios(pairs: list[Pair], conc: dict[str, dict[str, float]], peers: list[str]) -> str:
    """kvgate's figures over each peer's, from the same run: below 1 is kvgate ahead."""
    if not peers:
        return ""
    lines = [
        "| kvgate / peer | (a) added p50 | (a) added p99 | (b) added p99 | CPU per request | requests/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    added = {p.name: p.added_ms for p in pairs}
    cpu = {name.rsplit(" x", 1)[0]: c for name, c in conc.items()}
    kvgates = [label for label in cpu if label.startswith("kvgate")]
    for peer in peers:
        for label in kvgates:
            a, pa = added[f"(a) sequential [{label}]"], added[f"(a) sequential [{peer}]"]
            b, pb = added[f"(b) stream first chunk [{label}]"], added[f"(b) stream first chunk [{peer}]"]
            k, r = cpu[label], cpu[peer]
            lines.append(
                f"| {label} / {peer} | {a['p50'] / pa['p50']:.2f} | {a['p99'] / pa['p99']:.2f} | "
                f"{b['p99'] / pb['p99']:.2f} | "
                f"{k['gateway_cpu_us_per_request'] / r['gateway_cpu_us_per_request']:.2f} | "
                f"{k['rps'] / r['rps']:.2f} |"
            )
    return "\n".join(lines)


def rename_table(pairs: list[Pair], cost: dict[str, float]) -> str:
    lines = pair_rows(pairs, "rename (same alias)", "rewrite_model false", "renamed")
    lines += [
        "",
        f"In process: rename of a whole body {cost['body_rename_us']:.2f} us; a streamed chunk through the "
        f"event rewriter {cost['chunk_events_us']:.2f} us, renamed {cost['chunk_events_renamed_us']:.2f} us.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("-n", type=int, default=3000, help="sequential requests per side")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round and side")
    parser.add_argument(
        "--server",
        choices=["httptools", "aiohttp", "both"],
        default="httptools",
        help="the gateway's HTTP server (server.impl); both: one gateway each, side by side",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the concurrent measurement, sides alternating"
    )
    parser.add_argument("--out", default="results/out/overhead")
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=[SGLANG_ROUTER],
        default=[],
        help=f"other routers measured beside kvgate in one run ({SGLANG_ROUTER}: {SGLANG_ROUTER_INSTALL})",
    )
    parser.add_argument(
        "--variant",
        type=variant,
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="a kvgate side run by this interpreter's install of kvgate (repeat: side by side), e.g. "
        "interpreted=.venv/bin/python compiled=.venv-compiled/bin/python; default: this interpreter",
    )
    parser.add_argument("--no-rename", action="store_true", help="skip the model-rename pairs")
    parser.add_argument(
        "--no-request-id-echo",
        action="store_true",
        help="an upstream that does not echo X-Request-Id (like SGLang): no connection is reused",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the upstream and each proxy to a core of its own (taskset), the clients to the rest",
    )
    parser.add_argument(
        "--transport",
        choices=["http1", "aiohttp", "both"],
        default="http1",
        help="the gateway's upstream transport; both: one gateway each, side by side",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.duration, args.rounds = 200, 2.0, 1
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(
        json.dumps({k: v for k, v in result.items() if k != "table"}, indent=2)
    )
    (out / "overhead.md").write_text(str(result["table"]) + "\n")
    print(result["table"])
    print(f"\npercentiles over {args.n} interleaved requests per side; written to {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
