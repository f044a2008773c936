"""Idle and half-open client connections: how long a gateway holds them, and whether it still
answers when they exhaust its connection budget.

1. Half-open: `--half-open N` connections each send an unfinished request head, then nothing;
   the time until the gateway closes each one is recorded (up to `--wait` seconds).
2. Flood: with the gateway's file-descriptor limit set to `--nofile`, `--flood M` connections are
   opened and left idle; then `GET /health` and a completion are tried (3 s timeout each), and
   the gateway's log is searched for its warning.

With `--compare DIR` a gateway from another source tree (e.g. `git archive <rev> | tar -x -C
DIR`) goes through the same steps in the same run. Run: `python -m bench.conn_flood [--compare DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.overhead import gateway_config, pct
from bench.procs import HOST, Child, free_port_range, python_module, source_trees, write_report

PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'


def with_nofile(argv: list[str], nofile: int) -> list[str]:
    """`argv` run with its file-descriptor limit set to `nofile`."""
    limit = f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))"
    code = f"import os, resource, sys; {limit}; os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", code, *argv]


async def half_open(port: int, n: int, wait_s: float) -> dict[str, Any]:
    conns = []
    for _ in range(n):
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            break
        writer.write(PARTIAL_HEAD)
        conns.append((reader, writer))
    t0 = time.monotonic()

    async def closed_at(reader: asyncio.StreamReader) -> float | None:
        try:
            async with asyncio.timeout(wait_s):
                while await reader.read(4096):
                    pass
        except TimeoutError:
            return None
        except OSError:
            pass
        return time.monotonic() - t0

    times = await asyncio.gather(*(closed_at(r) for r, _ in conns))
    for _, writer in conns:
        writer.close()
    closed = sorted(t for t in times if t is not None)
    return {
        "opened": len(conns),
        "closed_by_gateway": len(closed),
        "still_open_after_s": wait_s if len(closed) < len(conns) else None,
        "close_time_p50_s": pct(closed, 0.5) if closed else None,
        "close_time_max_s": closed[-1] if closed else None,
    }


async def flood(url: str, port: int, m: int) -> dict[str, Any]:
    conns = []
    for _ in range(m):
        try:
            conns.append(await asyncio.wait_for(asyncio.open_connection(HOST, port), 3))
        except (OSError, TimeoutError):
            break
    await asyncio.sleep(1.0)
    results: dict[str, Any] = {"opened": len(conns)}
    timeout = aiohttp.ClientTimeout(total=3)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as s:
        for name, method, path, data in (
            ("health", "GET", "/health", None),
            ("completion", "POST", "/v1/chat/completions", BODY),
        ):
            ok, lat = 0, []
            for _ in range(10):
                t0 = time.perf_counter()
                try:
                    async with s.request(method, url + path, data=data) as r:
                        await r.read()
                        ok += r.status == 200
                        lat.append((time.perf_counter() - t0) * 1e3)
                except (aiohttp.ClientError, TimeoutError, OSError):
                    pass
            results[f"{name}_ok_of_10"] = ok
            results[f"{name}_p50_ms"] = pct(lat, 0.5) if lat else None
    for _, writer in conns:
        writer.close()
    return results


async def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    trees = source_trees(args.compare)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-connflood-"))
    out: dict[str, dict[str, Any]] = {}
    for i, (name, env) in enumerate(trees.items()):
        base = free_port_range(2)
        upstream_url, url = f"http://{HOST}:{base}", f"http://{HOST}:{base + 1}"
        config = gateway_config(upstream_url, base + 1)
        config["upstream"] = {"max_connections": 256}  # leaves the rest of --nofile to clients
        cfg = workdir / f"gw{i}.yaml"
        cfg.write_text(yaml.safe_dump(config))
        log = workdir / f"gw{i}.log"
        argv = with_nofile(python_module("gateway", "serve", "--config", str(cfg)), args.nofile)
        upstream = Child(
            "upstream", python_module("bench.echo_upstream", "--port", str(base)), workdir / "up.log"
        )
        gateway = Child(name, argv, log, env=env)
        with upstream.start(), gateway.start():
            upstream.wait_ready([upstream_url + "/health"], 30)
            gateway.wait_ready([url + "/ready"], 30)
            result: dict[str, Any] = {}
            result["half_open"] = await half_open(base + 1, args.half_open, args.wait)
            result["flood"] = await flood(url, base + 1, args.flood)
        text = log.read_text(errors="replace")
        result["flood"]["cap_warnings_logged"] = text.count("client connections at the cap")
        result["flood"]["accept_errors_logged"] = text.count("out of system resource") + text.count(
            "Too many open"
        )
        out[name] = result
    return out


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"| gateway | {args.half_open} half-open: closed by the gateway within {args.wait:g} s | close time "
        f"p50 / max (s) | {args.flood} idle connections (nofile {args.nofile}): /health ok | completion ok "
        "| warnings / accept errors logged |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        h, f = r["half_open"], r["flood"]
        times = (
            f"{h['close_time_p50_s']:.1f} / {h['close_time_max_s']:.1f}"
            if h["close_time_p50_s"] is not None
            else "-"
        )
        lines.append(
            f"| {name} | {h['closed_by_gateway']} of {h['opened']} | {times} | {f['health_ok_of_10']}/10 "
            f"| {f['completion_ok_of_10']}/10 | {f['cap_warnings_logged']} / {f['accept_errors_logged']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.conn_flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--half-open", type=int, default=3000)
    parser.add_argument("--wait", type=float, default=20.0, help="seconds to watch the half-open connections")
    parser.add_argument("--flood", type=int, default=3000)
    parser.add_argument("--nofile", type=int, default=2048, help="the gateway's file-descriptor limit")
    parser.add_argument("--compare", help="another source tree to run a second gateway from")
    parser.add_argument("--out", default="results/out/conn_flood")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    write_report(Path(args.out), "conn_flood", {"results": results}, table(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
