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
Run: `python -m bench.overhead [--quick] [--transport http1|aiohttp|both]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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
        # Interleaved so every side sees the same machine state (other load, CPU frequency).
        for _ in range(n):
            for side, url in sides.items():
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
    out = {"requests": done, "errors": errors, "rps": done / elapsed, **summary([v * 1e3 for v in lat])}
    if pid:
        out["gateway_cpu_us_per_request"] = cpu / max(done, 1) * 1e6
    return out


def gateway_config(upstream: str, port: int, transport: str) -> dict[str, object]:
    return {
        "server": {"host": HOST, "port": port, "access_log": False, "log_level": "warning"},
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
        "| concurrent clients | requests/s | p50 / p99 (ms) | errors | gateway CPU per request |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for name, c in conc.items():
        cpu = c.get("gateway_cpu_us_per_request")
        cpu_text = f"{cpu:.0f} us" if cpu is not None else "-"
        lines.append(
            f"| {name} | {c['rps']:.0f} | {c['p50']:.2f} / {c['p99']:.2f} | {c['errors']:.0f} | {cpu_text} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, object]:
    transports = ["http1", "aiohttp"] if args.transport == "both" else [args.transport]
    base = free_port_range(1 + len(transports))
    upstream_url = f"http://{HOST}:{base}"
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-overhead-"))
    upstream = Child(
        "upstream", python_module("bench.echo_upstream", "--port", str(base)), workdir / "up.log"
    )
    gateways: dict[str, tuple[str, Child]] = {}
    for i, transport in enumerate(transports, start=1):
        cfg = workdir / f"gateway-{transport}.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(upstream_url, base + i, transport)))
        argv = python_module("gateway", "serve", "--config", str(cfg))
        gateways[transport] = (
            f"http://{HOST}:{base + i}",
            Child(f"gateway-{transport}", argv, workdir / f"{transport}.log"),
        )
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        stack.enter_context(upstream.start())
        for _, child in gateways.values():
            stack.enter_context(child.start())
        upstream.wait_ready([upstream_url + "/health"], 30)
        for url, child in gateways.values():
            child.wait_ready([url + "/ready"], 30)
        path = "/v1/chat/completions"
        urls = {t: url + path for t, (url, _) in gateways.items()}
        pairs = [
            *await sequential(upstream_url + path, urls, args.n, BODY, False, "(a) sequential"),
            *await sequential(upstream_url + path, urls, args.n, STREAM_BODY, True, "(b) stream first chunk"),
        ]
        # The rename pairs, on the first gateway: the same alias, renamed against not.
        gw = next(iter(urls.values()))
        raw_body, raw_stream = _aliased(BODY, "alias-raw"), _aliased(STREAM_BODY, "alias-raw")
        renamed_body = {"renamed": _aliased(BODY, "alias")}
        renamed_stream = {"renamed": _aliased(STREAM_BODY, "alias")}
        renames = [
            *await sequential(gw, {"renamed": gw}, args.n, raw_body, False, "(a) alias", renamed_body),
            *await sequential(
                gw, {"renamed": gw}, args.n, raw_stream, True, "(b) alias chunk", renamed_stream
            ),
        ]
        conc = {
            f"direct x{args.clients}": await concurrent(
                upstream_url + path, args.clients, args.duration, None
            )
        }
        for t, (url, child) in gateways.items():
            assert child.proc is not None
            conc[f"gateway [{t}] x{args.clients}"] = await concurrent(
                url + path, args.clients, args.duration, child.proc.pid
            )
    cost = rewrite_cost()
    load = f"load average (1 min) {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    return {
        "pairs": [{**asdict(p), "added_ms": p.added_ms} for p in pairs],
        "concurrent": conc,
        "rename_pairs": [{**asdict(p), "added_ms": p.added_ms} for p in renames],
        "rewrite_cost_us": cost,
        "load": load,
        "table": table(pairs, conc) + "\n\n" + rename_table(renames, cost) + f"\n\n{load}",
    }


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
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--out", default="bench/out/overhead")
    parser.add_argument(
        "--transport",
        choices=["http1", "aiohttp", "both"],
        default="http1",
        help="the gateway's upstream transport; both: one gateway each, side by side",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.duration = 200, 2.0
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
