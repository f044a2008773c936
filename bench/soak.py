"""A long run at modest load with the gateway's memory sampled: does its RSS level off?

Four simulated replicas (one process), one gateway (prefix_affinity, access log on) and C
clients in a closed loop for `--minutes`. Most requests are streaming chats with a question of
their own after one of `--groups` shared system prompts, so the gateway's bounded caches (token
counts, prompt pieces, the prefix index) fill up over the run; the rest walk the other paths: a
client that leaves after the first chunk, a model that does not exist (a new name each time), a
body that is not JSON, `/tokenize`, `/v1/responses` (a question of its own) and `/v1/models`.
The gateway's RSS (VmRSS) is read every `--sample-s` seconds.

The bound reported is max - min RSS after `--warmup-min` minutes. Run:
`python -m bench.soak --minutes 30 [--server aiohttp] [--small-caches]` (`--minutes 3 --sample-s 10`
for a smoke run; `--small-caches` bounds the caches low enough to fill in a minute or two, so that a
short run shows whether anything else grows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.faults import FaultLoad, Outcome, prompt, stream_chat
from bench.loadgen import run_sync
from bench.procs import HOST, Child, free_port_range, python_module

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MIX = (
    ("chat", 0.84),
    ("abandon", 0.04),
    ("unknown_model", 0.03),
    ("bad_json", 0.03),
    ("tokenize", 0.02),
    ("responses", 0.02),
    ("models", 0.02),
)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# `--small-caches`: bounds the two caches reach within a minute or two of this load, so that what
# the RSS does after that is not their filling.
SMALL_CACHES = {"max_blocks_per_replica": 2048, "token_cache_entries": 4096}


def gateway_config(
    fleet_base: int, replicas: int, port: int, server: str = "httptools", small_caches: bool = False
) -> dict[str, Any]:
    endpoints = [
        {"url": f"http://{HOST}:{fleet_base + i}", "name": f"r{i}", "kind": "sim"} for i in range(replicas)
    ]
    pool: dict[str, Any] = {"name": "soak", "model": MODEL, "policy": {"type": "prefix_affinity"}}
    if small_caches:
        pool["prefix"] = SMALL_CACHES
    return {
        "server": {"host": HOST, "port": port, "access_log": True, "log_level": "info", "impl": server},
        "pools": [{**pool, "endpoints": endpoints}],
    }


async def client(worker: int, url: str, load: FaultLoad, deadline: float, counts: dict[str, int]) -> None:
    rng = random.Random(f"soak:{worker}")
    kinds, weights = zip(*MIX, strict=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            kind = rng.choices(kinds, weights)[0]
            rec = Outcome(f"soak-{worker}-{n}", 0.0)
            if kind in ("chat", "abandon"):
                body = {
                    "model": MODEL,
                    "messages": prompt(load, 0, worker * 10_000_000 + n),
                    "max_tokens": load.max_tokens,
                    "stream": True,
                    "ignore_eos": True,
                }
                await stream_chat(session, url, body, rec, drop=kind == "abandon")
                counts[f"{kind}:{rec.outcome}"] = counts.get(f"{kind}:{rec.outcome}", 0) + 1
                continue
            method, path, data = "POST", "/v1/completions", b""
            if kind == "unknown_model":
                data = orjson.dumps({"model": f"nope-{rng.getrandbits(64):x}", "prompt": "x"})
            elif kind == "bad_json":
                data = b'{"model": "' + MODEL.encode() + b'", "prompt": '
            elif kind == "tokenize":
                path, data = "/tokenize", orjson.dumps({"model": MODEL, "prompt": f"question {worker}-{n}"})
            elif kind == "responses":
                question = f"question {worker}-{n}: what is {rng.random()}?"
                path = "/v1/responses"
                data = orjson.dumps({"model": MODEL, "input": question, "max_output_tokens": load.max_tokens})
            else:
                method, path = "GET", "/v1/models"
            try:
                async with session.request(method, url + path, data=data or None) as r:
                    await r.read()
                    counts[f"{kind}:{r.status}"] = counts.get(f"{kind}:{r.status}", 0) + 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                counts[f"{kind}:{type(exc).__name__}"] = counts.get(f"{kind}:{type(exc).__name__}", 0) + 1


_CACHES = re.compile(
    r"^(kvgate_prefix_index_entries|kvgate_token_count_cache_entries)\{[^}]*\} ([0-9.e+]+)$", re.M
)


async def caches(url: str) -> dict[str, int]:
    """The gateway's bounded caches, summed over pools: what most of its memory holds."""
    out = {"kvgate_prefix_index_entries": 0, "kvgate_token_count_cache_entries": 0}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s,
        s.get(url + "/metrics") as r,
    ):
        for name, value in _CACHES.findall(await r.text()):
            out[name] += int(float(value))
    return out


async def sampler(
    pid: int, url: str, every_s: float, deadline: float, counts: dict[str, int], rows: list[dict[str, Any]]
) -> None:
    t0 = time.monotonic()
    while True:
        filled = await caches(url)
        row = {
            "minute": round((time.monotonic() - t0) / 60, 2),
            "requests": sum(counts.values()),
            "rss_mb": round(rss_mb(pid), 1),
            "index_entries": filled["kvgate_prefix_index_entries"],
            "token_cache_entries": filled["kvgate_token_count_cache_entries"],
        }
        rows.append(row)
        print(
            f"  {row['minute']:6.2f} min  {row['requests']:7d} requests  RSS {row['rss_mb']:.1f} MB",
            flush=True,
        )
        if time.monotonic() + every_s > deadline + 1:
            return
        await asyncio.sleep(every_s)


async def drive(args: argparse.Namespace, pid: int, url: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    load = FaultLoad(max_tokens=args.max_tokens, groups=args.groups)
    deadline = time.monotonic() + args.minutes * 60
    counts: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    sampling = asyncio.create_task(sampler(pid, url, args.sample_s, deadline, counts, rows))
    await asyncio.gather(*(client(w, url, load, deadline, counts) for w in range(args.concurrency)))
    await sampling
    return rows, counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
    base = free_port_range(args.replicas + 1)
    port = base + args.replicas
    fleet_argv = python_module(
        "gateway.sim", "--model", MODEL, "--port", str(base), "--replicas", str(args.replicas),
        "--profile", "h200-llama3.1-8b", "--speedup", str(args.speedup),
        "--enable-request-id-headers",  # as the launcher starts engines: connections to them are kept
    )  # fmt: skip
    cfg = workdir / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(gateway_config(base, args.replicas, port, args.server, args.small_caches)))
    fleet = Child("fleet", fleet_argv, workdir / "fleet.log")
    gateway = Child(
        "gateway", python_module("gateway", "serve", "--config", str(cfg)), workdir / "gateway.log"
    )
    url = f"http://{HOST}:{port}"
    with fleet.start(), gateway.start():
        fleet.wait_ready([f"http://{HOST}:{base + i}/health" for i in range(args.replicas)], 60)
        gateway.wait_ready([url + "/ready"], 60)
        assert gateway.proc is not None
        rows, counts = run_sync(drive(args, gateway.proc.pid, url))
    after = [r["rss_mb"] for r in rows if r["minute"] >= args.warmup_min]
    return {
        "rows": rows,
        "counts": counts,
        "warmup_min": args.warmup_min,
        "bound_mb": round(max(after) - min(after), 1) if after else None,
        "load_average": os.getloadavg(),
        "logs": str(workdir),
    }


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"# kvgate soak ({args.server} server{', small caches' if args.small_caches else ''}):"
        f" {args.minutes:g} min, {args.concurrency} clients, RSS every {args.sample_s:g} s",
        "",
        "| minute | requests so far | gateway RSS (MB) | prefix index entries | token-count cache entries |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['minute']:g} | {r['requests']} | {r['rss_mb']:.1f} | {r['index_entries']} "
            f"| {r['token_cache_entries']} |"
            for r in result["rows"]
        ),
        "",
        f"After {result['warmup_min']:g} min of warm-up the RSS stayed within {result['bound_mb']} MB "
        f"(max - min). Load average at the end: {' '.join(f'{x:.2f}' for x in result['load_average'])}.",
        "",
        "Requests by kind and outcome: " + ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items())),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--warmup-min", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=4.0, help="simulator speedup")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--groups", type=int, default=64, help="shared system prompts")
    parser.add_argument("--server", choices=["httptools", "aiohttp"], default="httptools", help="server.impl")
    parser.add_argument(
        "--small-caches", action="store_true", help=f"prefix: {SMALL_CACHES}: caches full within minutes"
    )
    parser.add_argument("--out", default="results/out/soak")
    args = parser.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    text = markdown(result, args)
    (out / "soak.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
