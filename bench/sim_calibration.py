"""Calibration of the engine simulator against real vLLM on an H200, plus its own CPU cost.

`python -m bench.sim_calibration [--profile NAME] [--skip-realtime] [--concurrency 256] [--seconds 8]`

Part 1 runs the profile on the virtual clock through the same measurements as calibration-h200-vllm.md (cold
prefill, prefix-cache hit, decode step vs batch, KV capacity), and four replicas time-sharing one GPU through
the routing scenario's h200 size as the bench/gpu run of 2026-12-01 did, and prints each figure beside the
measured one with their ratio; `!!` marks anything more than 15% off. Part 2 starts one simulator process at
--speedup 1, holds N concurrent streaming requests through it, and reports the process's CPU use and how late
its step timer fires (event-loop lag).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import random
import re
import sys
import time
from pathlib import Path
from statistics import median

import aiohttp

from bench import loadgen
from bench.loadgen import LoadSpec
from bench.overhead import cpu_seconds
from bench.scenario import load_scenario
from bench.workloads import BenchRequest, make_workload
from gateway.sim.device import TimeSlicedGPU
from gateway.sim.engine import Engine, EngineConfig, Request, run_collecting_gaps
from gateway.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.15

# calibration-h200-vllm.md (vLLM 0.26, H200, Llama-3.1-8B shapes), milliseconds unless noted.
MEASURED_BLOCKS = {"bf16": 52_478, "fp8": 104_925}
MEASURED_PREFILL = {  # prompt tokens: (TTFT bf16, server prefill bf16, TTFT fp8, server prefill fp8)
    128: (13.1, 8.7, 18.6, 12.7),
    512: (20.7, 15.1, 22.3, 16.3),
    1024: (32.2, 25.8, 33.3, 26.3),
    2048: (55.6, 49.0, 59.9, 49.2),
    4096: (112.0, 99.9, 110.1, 98.6),
    8000: (221.3, 207.0, 219.8, 200.8),
}
MEASURED_HIT = {"cold 4000": 107.3, "4000 cached + 100": 24.4, "cold 4100": 111.0}  # medians of three
MEASURED_DECODE = {  # (prompt, kv dtype, concurrency): (median gap, per-token time, output tok/s)
    (512, "bf16", 1): (4.95, 4.95, 197),
    (512, "bf16", 8): (5.12, 5.09, 1341),
    (512, "bf16", 16): (5.27, 5.22, 2295),
    (512, "bf16", 32): (5.77, 6.14, 3607),
    (512, "bf16", 64): (6.52, 8.30, 5032),
    (512, "bf16", 128): (9.49, 12.13, 6000),
    (512, "bf16", 256): (14.76, 26.01, 6439),
    (512, "fp8", 1): (4.97, 4.96, 195),
    (512, "fp8", 8): (5.15, 5.13, 1330),
    (512, "fp8", 32): (5.74, 5.76, 3474),
    (512, "fp8", 64): (6.42, 7.70, 5015),
    (512, "fp8", 128): (8.32, 11.34, 6264),
    (2048, "bf16", 1): (5.03, None, None),
    (2048, "bf16", 32): (7.18, 11.9, 1592),
}

Row = tuple[str, float | None, float]  # label, measured (None: no measurement), simulated


def dtype_flag(dtype: str) -> str:
    return "auto" if dtype == "bf16" else "fp8"


def new_engine(profile: str, dtype: str) -> Engine:
    return Engine(
        EngineConfig(
            get_profile(profile),
            kv_cache_dtype=dtype_flag(dtype),
            gpu_memory_utilization=0.85,
            max_model_len=8192,
        )
    )


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100_000) for _ in range(n)]


def alone(e: Engine, ids: list[int]) -> Request:
    r = Request(f"r{e.steps}", ids, 1, block_size=e.block_size)
    e.add_request(r)
    e.run_until_idle()
    return r


def capacity_rows(profile: str) -> list[Row]:
    return [
        (f"num_gpu_blocks, {d} KV", MEASURED_BLOCKS[d], new_engine(profile, d).pool.num_blocks)
        for d in ("bf16", "fp8")
    ]


def prefill_rows(profile: str) -> list[Row]:
    rows: list[Row] = []
    rng = random.Random(1)
    for n, (ttft_b, pre_b, ttft_f, pre_f) in MEASURED_PREFILL.items():
        for dtype, ttft_m, pre_m in (("bf16", ttft_b, pre_b), ("fp8", ttft_f, pre_f)):
            r = alone(new_engine(profile, dtype), tokens(n, rng))
            server = (r.first_token_at - r.scheduled_at) * 1e3  # type: ignore[operator]
            rows.append((f"cold {n:>4} tok {dtype}: TTFT", ttft_m, r.ttft * 1e3))  # type: ignore[operator]
            rows.append((f"cold {n:>4} tok {dtype}: server prefill", pre_m, server))
    return rows


def hit_rows(profile: str) -> list[Row]:
    rng = random.Random(2)
    e = new_engine(profile, "bf16")
    base = tokens(4000, rng)
    cold = alone(e, base).ttft
    hit = alone(e, base + tokens(100, rng))
    control = alone(new_engine(profile, "bf16"), tokens(4100, rng)).ttft
    assert hit.num_cached == 4000, hit.num_cached
    sim = {"cold 4000": cold, "4000 cached + 100": hit.ttft, "cold 4100": control}
    return [(f"TTFT {k}", v, sim[k] * 1e3) for k, v in MEASURED_HIT.items()]  # type: ignore[operator]


def decode_run(profile: str, prompt_len: int, dtype: str, conc: int) -> tuple[float, float, float]:
    """All requests start together (like the measurement); returns median gap, median per-token time of a
    request, and aggregate output tokens/s."""
    e = new_engine(profile, dtype)
    rng = random.Random(conc)
    reqs = [Request(f"d{i}", tokens(prompt_len, rng), 128, block_size=e.block_size) for i in range(conc)]
    gaps = run_collecting_gaps(e, reqs)
    tpot = median((r.finished_at - r.first_token_at) / 127 for r in reqs)  # type: ignore[operator]
    span = max(r.finished_at for r in reqs) - min(r.arrival for r in reqs)  # type: ignore[type-var]
    return median(gaps) * 1e3, tpot * 1e3, conc * 128 / span


def decode_rows(profile: str) -> list[Row]:
    rows: list[Row] = []
    for (plen, dtype, conc), (gap_m, tpot_m, tps_m) in MEASURED_DECODE.items():
        gap, tpot, tps = decode_run(profile, plen, dtype, conc)
        label = f"decode {plen} tok {dtype} x{conc:<3}"
        rows.append((f"{label}: median gap", gap_m, gap))
        rows.append((f"{label}: per-token time*", tpot_m, tpot))
        rows.append((f"{label}: output tok/s*", tps_m, tps))
    return rows


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"


def table(title: str, rows: list[Row], unit: str) -> tuple[str, int]:
    lines = [
        f"### {title}",
        "",
        f"| figure | measured {unit} | simulated {unit} | sim/measured |",
        "| --- | ---: | ---: | ---: |",
    ]
    off = 0
    for label, measured, sim in rows:
        if measured is None:
            lines.append(f"| {label} | - | {_num(sim)} | - |")
            continue
        ratio = sim / measured
        flag = ""
        if abs(ratio - 1) > TOLERANCE:
            flag = " !!"
            off += not label.endswith("*")
        lines.append(f"| {label} | {_num(measured)} | {_num(sim)} | {ratio:.2f}{flag} |")
    return "\n".join(lines), off


# ---- part 1b: four replicas time-sharing one H200 (bench/gpu, 2026-12-01) -------------------------------
# vLLM 0.26, FP8 KV with 6,227,702,579 bytes (95,024 tokens) per replica, the routing scenario's h200 size
# through kvgate: round-robin's capacity (600 requests offered at 40 req/s, served over the run's span)
# and TTFT (ms) at 90% of it, and groups pinned to replicas (the oracle policy) at the same rate.
SHARED_KV_BYTES = 6_227_702_579
SHARED_REPLICAS = 4
MEASURED_SHARED = {
    "round_robin capacity (req/s)": 23.05,
    "round_robin @ 20.74: TTFT p50": 493.7,
    "round_robin @ 20.74: TTFT p95": 1792.8,
    "round_robin @ 20.74: TTFT mean": 654.9,
    "round_robin @ 20.74: hit rate": 0.330,
    "oracle @ 20.74: TTFT p50": 93.7,
    "oracle @ 20.74: TTFT p95": 468.5,
    "round_robin @ 30.71: TTFT p50": 5223.6,
}


@functools.cache
def shared_workload() -> list[BenchRequest]:
    """The routing scenario's h200 size, in its order (seed 0, as the scenario's)."""
    return make_workload("shared-prefix", load_scenario("routing").size("h200").workload).build(0)


def shared_gpu_run(profile: str, rate: float, policy: str, n: int | None = None) -> list[Request]:
    """The first `n` requests of the workload at the load generator's own Poisson send times (its seed 0,
    as the H200 run's) over SHARED_REPLICAS engines stepping on one TimeSlicedGPU, on a virtual clock;
    `policy` round_robin or oracle (group g on replica g mod N). Returns the requests, finished. Each
    group's system prompt is the same ids, each question its own (the chat template's tokens left out)."""
    p = get_profile(profile)
    cfg = EngineConfig(p, kv_cache_dtype="fp8", kv_cache_memory_bytes=SHARED_KV_BYTES, max_model_len=8192)
    engines = [Engine(cfg) for _ in range(SHARED_REPLICAS)]
    gpu = TimeSlicedGPU(p.timeslice_efficiency)
    bench = shared_workload()[:n]
    question = load_scenario("routing").size("h200").workload["question_tokens"]
    arrivals: list[tuple[float, int, Request]] = []
    for at, r in zip(loadgen.schedule(bench, LoadSpec(rate=rate)), bench, strict=True):
        g = int(r.group[1:])  # type: ignore[index]
        ids = [g * 10_000 + i for i in range(r.prompt_tokens - question)]
        ids += [50_000_000 + r.index * 1_000 + i for i in range(question)]
        replica = r.index % SHARED_REPLICAS if policy == "round_robin" else g % SHARED_REPLICAS
        arrivals.append((at, replica, Request(f"r{r.index}", ids, r.max_tokens)))
    steps: dict[int, tuple[dict[Request, int], float]] = {}  # replica -> its step in progress, start
    now, nxt = 0.0, 0
    while nxt < len(arrivals) or any(e.has_work() or e.num_waiting for e in engines) or steps:
        for i, e in enumerate(engines):
            if i not in steps:
                e.now = max(e.now, now)
                e.tick()
                sched, shape = e.schedule() if e.has_work() else ({}, None)
                if sched and shape is not None:
                    gpu.start(i, e.cost.step_time(shape), now)
                    steps[i] = (sched, now)
        times = [arrivals[nxt][0]] if nxt < len(arrivals) else []
        idle = [e.next_event_time() for i, e in enumerate(engines) if i not in steps]
        times += [t for t in (gpu.next_end(), *idle) if t is not None]
        if not times:
            break  # nothing left that can ever run
        now = max(now, min(times))
        gpu.advance(now)
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            at, replica, req = arrivals[nxt]
            engines[replica].add_request(req, at=at)
            nxt += 1
        for i, end in list(gpu.done.items()):
            sched, start = steps.pop(i)
            del gpu.done[i]
            e = engines[i]
            e.now = end
            e._after_step(e.complete(sched, end - start))
    return [r for _, _, r in arrivals]


def shared_rows(profile: str) -> list[Row]:
    def served(reqs: list[Request]) -> float:
        """Completions per second from the first arrival to the last completion (bench.gpu.host's)."""
        return len(reqs) / (max(r.finished_at or 0.0 for r in reqs) - min(r.arrival for r in reqs))

    def ms(reqs: list[Request], q: float | None) -> float:
        ttft = sorted(r.ttft * 1e3 for r in reqs)  # type: ignore[operator]
        return sum(ttft) / len(ttft) if q is None else ttft[min(len(ttft) - 1, int(q * len(ttft)))]

    capacity = served(shared_gpu_run(profile, 40.0, "round_robin", 600))
    rr, oracle = shared_gpu_run(profile, 20.74, "round_robin"), shared_gpu_run(profile, 20.74, "oracle")
    over = shared_gpu_run(profile, 30.71, "round_robin")
    sim = {
        "round_robin capacity (req/s)": capacity,
        "round_robin @ 20.74: TTFT p50": ms(rr, 0.5),
        "round_robin @ 20.74: TTFT p95": ms(rr, 0.95),
        "round_robin @ 20.74: TTFT mean": ms(rr, None),
        "round_robin @ 20.74: hit rate": sum(r.num_cached for r in rr) / sum(r.prompt_len for r in rr),
        "oracle @ 20.74: TTFT p50": ms(oracle, 0.5),
        "oracle @ 20.74: TTFT p95": ms(oracle, 0.95),
        "round_robin @ 30.71: TTFT p50": ms(over, 0.5),
    }
    return [(k, v, sim[k]) for k, v in MEASURED_SHARED.items()]


# ---- part 2: one real simulator process under 256 concurrent streams ------------------------------------
LISTEN = re.compile(rb"listening on (http://[\d.]+:\d+)")


async def _stream(
    session: aiohttp.ClientSession, url: str, max_tokens: int, i: int
) -> tuple[int, list[float]]:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"request {i}: " + "lorem ipsum " * 200}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    chunks = 0
    stamps: list[float] = []
    # iter_any and a byte count keep the client cheap: on 2 cores it must not starve the simulator.
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        async for piece in resp.content.iter_any():
            chunks += piece.count(b"data: {")
            stamps.append(time.perf_counter())
    return chunks, [b - a for a, b in itertools.pairwise(stamps)]


async def realtime(profile: str, concurrency: int, seconds: float) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.sim", "--profile", profile, "--port", "0", "--speedup", "1",
        "--max-num-seqs", str(max(concurrency, 256)), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)  # type: ignore[union-attr]
        m = LISTEN.search(line)
        if m is None:
            raise RuntimeError(f"simulator did not start: {line!r}")
        url = m.group(1).decode()
        # ~15 ms decode steps at batch 256: enough tokens to keep every stream busy for `seconds`.
        max_tokens = int(seconds / 0.015)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            results = await asyncio.gather(
                *(_stream(session, url, max_tokens, i) for i in range(concurrency))
            )
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(proc.pid) - cpu0
            async with session.get(f"{url}/sim/state") as r:
                st = await r.json()
        chunks = sum(c for c, _ in results)
        gaps = sorted(g for _, gs in results for g in gs)
        lag = st["step_timer_lag"]
        return "\n".join(
            [
                f"### One simulator process, {concurrency} concurrent streams at --speedup 1 ({profile})",
                "",
                "| figure | value |",
                "| --- | ---: |",
                f"| wall time | {wall:.1f} s |",
                f"| simulator CPU (one core = 100%) | {100 * cpu / wall:.0f}% |",
                f"| SSE chunks delivered | {chunks:,} ({chunks / wall:,.0f}/s) |",
                f"| simulator CPU per chunk | {cpu / max(chunks, 1) * 1e6:.0f} us |",
                f"| client-side median inter-chunk gap | {gaps[len(gaps) // 2] * 1e3:.2f} ms |",
                "| step-timer lag p50 / p99 / max | "
                f"{lag['p50_ms']:.2f} / {lag['p99_ms']:.2f} / {lag['max_ms']:.2f} ms |",
                f"| steps dropped for lag > 50 ms | {st['lag_events']} |",
                f"| steps | {st['steps']:,} |",
            ]
        )
    finally:
        proc.terminate()
        await proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim_calibration", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    ap.add_argument("--skip-realtime", action="store_true")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args(argv)
    p = get_profile(args.profile)
    print(f"## Simulator calibration: profile `{p.name}`\n\nSource: {p.source}\n")
    print(
        "Virtual clock. `!!`: more than 15% off. `*`: includes chunked-prefill interference; informational.\n"
    )
    total_off = 0
    for title, rows, unit in (
        ("KV capacity (gpu-memory-utilization 0.85)", capacity_rows(args.profile), "blocks"),
        ("Cold prefill, one request alone", prefill_rows(args.profile), "ms"),
        ("Prefix cache hit (bf16)", hit_rows(args.profile), "ms"),
        (
            "Decode, all requests started together, 128 output tokens",
            decode_rows(args.profile),
            "(ms, tok/s)",
        ),
        (
            f"{SHARED_REPLICAS} replicas time-sharing one GPU (--gpu-share {SHARED_REPLICAS}): routing h200 "
            "size at the H200 run's send times, template tokens and gateway left out",
            shared_rows(args.profile),
            "",
        ),
    ):
        text, off = table(title, rows, unit)
        total_off += off
        print(text + "\n")
    print(f"Figures more than 15% off (excluding `*`): {total_off}\n")
    if not args.skip_realtime:
        print(asyncio.run(realtime(args.profile, args.concurrency, args.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
