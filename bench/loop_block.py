"""How long one large prompt stalls everything else a gateway serves.

A prober sends `GET /health` on a keep-alive connection every 2 ms and records each answer's
latency; meanwhile a chat request whose prompt is `--mb` megabytes goes through the gateway to an
instant upstream (bench/echo_upstream.py). The worst probe latency while the large request is in
the gateway is how long its event loop was blocked. With `--compare DIR` a second gateway, run
from another source tree (e.g. an older commit: `git archive <rev> | tar -x -C DIR`), is measured
the same way in the same run, alternating, so the two see the same machine.

Run: `python -m bench.loop_block [--mb 7.5] [--repeat 5] [--compare DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from bench.overhead import gateway_config, pct
from bench.procs import HOST, Child, free_port_range, python_module, source_trees, write_report

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def big_body(mb: float, seed: int) -> bytes:
    rng = random.Random(seed)
    n = int(mb * 1_000_000)
    text = " ".join(rng.choice(WORDS) for _ in range(n // 5))[:n]
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    ).encode()


@dataclass
class Sample:
    big_ms: float  # the large request, end to end
    probe_max_ms: float  # worst probe latency while it was in flight
    probe_p99_ms: float


async def one(url: str, body: bytes) -> Sample:
    lat: list[tuple[float, float]] = []  # (sent at, latency)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as session:

        async def probe() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                async with session.get(url + "/health") as r:
                    await r.read()
                lat.append((t0, time.perf_counter() - t0))
                await asyncio.sleep(0.002)

        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", data=body) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"large request answered {r.status}")
        t1 = time.perf_counter()
        await asyncio.sleep(0.1)
        stop.set()
        await prober
    during = [d * 1e3 for t, d in lat if t1 >= t and t + d >= t0]
    return Sample((t1 - t0) * 1e3, max(during), pct(during, 0.99))


async def run(args: argparse.Namespace) -> dict[str, list[Sample]]:
    trees = source_trees(args.compare)
    base = free_port_range(1 + len(trees))
    upstream_url = f"http://{HOST}:{base}"
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-loopblock-"))
    upstream = Child(
        "upstream", python_module("bench.echo_upstream", "--port", str(base)), workdir / "up.log"
    )
    children, urls = [], {}
    for i, (name, env) in enumerate(trees.items()):
        port = base + 1 + i
        cfg = workdir / f"gw{i}.yaml"
        config = gateway_config(upstream_url, port)
        config["pools"][0]["policy"] = {"type": "prefix_affinity"}  # type: ignore[index]
        cfg.write_text(yaml.safe_dump(config))
        argv = python_module("gateway", "serve", "--config", str(cfg))
        children.append(Child(name, argv, workdir / f"gw{i}.log", env=env))
        urls[name] = f"http://{HOST}:{port}"
    body = big_body(args.mb, 0)
    results: dict[str, list[Sample]] = {name: [] for name in trees}
    with upstream.start():
        upstream.wait_ready([upstream_url + "/health"], 30)
        for child, url in zip(children, urls.values(), strict=True):
            child.start().wait_ready([url + "/ready"], 30)
        try:
            for _ in range(args.repeat):
                for name, url in urls.items():
                    results[name].append(await one(url, body))
        finally:
            for child in children:
                child.stop()
    return results


def table(results: dict[str, list[Sample]], mb: float) -> str:
    lines = [
        f"| gateway | {mb:g} MB request e2e p50 (ms) | worst /health latency during it, "
        "median / max of runs (ms) |",
        "| --- | ---: | ---: |",
    ]
    for name, samples in results.items():
        worst = sorted(s.probe_max_ms for s in samples)
        e2e = pct([s.big_ms for s in samples], 0.5)
        lines.append(f"| {name} | {e2e:.0f} | {pct(worst, 0.5):.1f} / {worst[-1]:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loop_block",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mb", type=float, default=7.5, help="prompt size in megabytes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--compare", help="another source tree to run a second gateway from")
    parser.add_argument("--out", default="results/out/loop_block")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    raw = {name: [s.__dict__ for s in samples] for name, samples in results.items()}
    write_report(Path(args.out), "loop_block", {"mb": args.mb, "runs": raw}, table(results, args.mb))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
