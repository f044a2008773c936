"""Gateway decision time: `PoolRouter.features` + `PoolRouter.route` with prefix_affinity, in process.

What the gateway spends per request between parsing the body and choosing a replica: serializing
the prompt, hashing its blocks, counting its tokens (block counts cached, as for any repeated
system prompt), walking the prefix index and ranking every replica. Each measured request is a
2k-token chat prompt (a 2048-token system prompt of one of 64 groups plus a new 128-token question)
against a pool whose replicas already hold the groups' prefixes, with in-flight load on them.

    python -m bench.decision_time                      # 16 and 256 replicas
    python -m bench.decision_time --replicas 16 --iterations 20000 --out results/routing
    python -m bench.decision_time --breakdown          # CPU time of each stage, taken one by one
    python -m bench.decision_time --replicas 1024 --max-candidates 32 --max-candidates 0  # shortlist vs all
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path

import xxhash

from bench import text
from bench.workloads import SharedPrefix
from gateway.config import load_config
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Lease, Replica
from gateway.routing.decision import Decision
from gateway.routing.policy import Candidate
from gateway.routing.pool_router import PoolRouter

TARGET_MS = {16: 0.3, 256: 1.0, 1024: 0.3}  # 1,024: issue 18
# The stages of a decision, as `--breakdown` times them (PoolRouter.route = shortlist, candidates,
# policy; shortlist: the available replicas offered, all of them up to the pool's policy.max_candidates).
STAGES = ("features", "shortlist", "candidates", "policy")


def build_pool(replicas: int, policy: str, block_chars: int = 64, max_candidates: int = 32) -> PoolRouter:
    settings = load_config(
        None,
        {
            "pools": [
                {
                    "name": "bench",
                    "model": "m",
                    "policy": {"type": policy, "max_candidates": max_candidates},
                    "prefix": {"block_chars": block_chars},
                    "endpoints": [{"url": f"http://127.0.0.1:{10000 + i}"} for i in range(replicas)],
                }
            ]
        },
    )
    pool = Pool(settings.pools[0], settings.breaker, settings.scrape)
    router = PoolRouter(pool)
    for i in range(replicas):
        pool.add_replica(f"http://127.0.0.1:{10000 + i}", name=f"r{i}")
    return router


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    replicas: int,
    iterations: int,
    policy: str,
    block_chars: int = 64,
    seed: int = 0,
    breakdown: bool = False,
    max_candidates: int = 32,
) -> dict[str, float]:
    pool = build_pool(replicas, policy, block_chars, max_candidates)
    workload = SharedPrefix()
    systems = [workload.system_prompt(seed, g) for g in range(workload.groups)]
    rng = random.Random(seed)
    sampling = random.Random(seed)  # the breakdown's shortlist samples
    inflight: list[tuple[Decision, Lease]] = []

    def finish(k: int) -> None:
        """The k-th request in flight ends: its load is released and its policy told."""
        decision, lease = inflight.pop(k)
        lease.release()
        decision.ended(200, None, None, 0.0, None, None)

    def take(decision: Decision, ranked: list[Candidate]) -> Replica:
        """The request goes to its best candidate, which takes its load."""
        chosen = decision.replica_of(ranked[0])
        assert chosen is not None
        decision.sent(chosen)
        inflight.append((decision, chosen.lease(decision.features.prompt_tokens)))
        return chosen

    def body(i: int) -> dict[str, object]:
        question = text.words(f"dt:{seed}:{i}", workload.question_tokens)
        system = systems[i % len(systems)]
        return {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        }

    # Warm up: every group's prefix routed once (the index learns where it lives), some load in flight.
    for i in range(len(systems) * 2):
        decision = pool.route(pool.features(body(-1 - i), "chat", f"warm-{i}", {}))
        take(decision, decision.ranked)
    for k in reversed(range(0, len(inflight), 2)):
        finish(k)
    # Bodies are prepared beforehand: the client's JSON parsing is not part of the decision.
    bodies = [body(i) for i in range(iterations)]
    times: list[float] = []
    cpu: list[float] = []  # CPU time of this thread: what the decision costs without other processes' noise
    stages: dict[str, list[float]] = {stage: [] for stage in STAGES}
    best_match = 0
    # The decisions themselves, in order: the same seed and code make the same digest (a
    # restructuring of the routing code must leave it unchanged where it leaves the pool unsampled).
    digest = xxhash.xxh64()
    excess: list[float] = []  # requests in flight on the busiest replica beyond the mean, per decision
    gc.collect()
    gc.disable()
    try:
        for i, b in enumerate(bodies):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            features = pool.features(b, "chat", f"req-{i}", {})
            if breakdown:
                c1 = time.thread_time()
                members = pool.pool.members("decode")
                large = max_candidates and len(members) > max_candidates
                serving = (
                    pool.match.shortlist(pool.pool, features, "decode", max_candidates, sampling)
                    if large
                    else pool.pool.serving("decode")
                )
                c2 = time.thread_time()
                candidates = pool.match.candidates(features, serving)
                c3 = time.thread_time()
                ranked = pool.policy.rank(features, candidates)
                c4 = time.thread_time()
                decision = Decision(pool, features, ranked, [])
                for stage, spent in zip(STAGES, (c1 - c0, c2 - c1, c3 - c2, c4 - c3), strict=True):
                    stages[stage].append(spent * 1e6)
            else:
                decision = pool.route(features)
                ranked = decision.ranked
            times.append((time.perf_counter() - t0) * 1000.0)
            cpu.append((time.thread_time() - c0) * 1000.0)
            # Quality, outside the timing: did the replica chosen hold as much of the prompt as the
            # best replica of the whole pool (a shortlist may have left that one out)?
            deepest = max(pool.match.index.match(features.block_hashes, pool.pool.replicas).values())
            best_match += ranked[0].matched_blocks >= deepest
            most = max(r.inflight_requests for r in pool.pool.replicas.values())
            excess.append(most - (len(inflight) + 1) / replicas)
            # Steady load: about 8 requests in flight per replica, finishing in random order.
            chosen = take(decision, ranked)
            digest.update(f"{chosen.name}:{ranked[0].matched_tokens};".encode())
            if len(inflight) > 8 * replicas:
                finish(rng.randrange(len(inflight)))
    finally:
        gc.enable()
    means = {f"{stage}_mean_us": statistics.mean(v) for stage, v in stages.items() if v}
    p99s = {f"{stage}_p99_us": percentile(v, 0.99) for stage, v in stages.items() if v}
    return {
        **means,
        **p99s,
        "replicas": replicas,
        "iterations": iterations,
        "p50_ms": statistics.median(times),
        "p99_ms": percentile(times, 0.99),
        "max_ms": max(times),
        "cpu_p50_ms": statistics.median(cpu),
        "cpu_p99_ms": percentile(cpu, 0.99),
        "best_match": best_match / iterations,
        "excess_inflight": statistics.mean(excess),
        "max_candidates": max_candidates,
        "decisions": digest.hexdigest(),
        "chars": len(features.text),
        "prompt_tokens": features.prompt_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decision_time", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--replicas", type=int, action="append", help="pool size; repeat (default 16 and 256)"
    )
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--policy", default="prefix_affinity")
    parser.add_argument(
        "--block-chars", type=int, default=64, help="pool prefix.block_chars (hashed block size)"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time PoolRouter.features and the stages of PoolRouter.route one by one (CPU us per request)",
    )
    parser.add_argument(
        "--max-candidates",
        type=int,
        action="append",
        help="pool policy.max_candidates (default 32; 0: every replica is a candidate); repeat to compare",
    )
    parser.add_argument("--out", type=Path, help="append the table to decision_time.md in this directory")
    args = parser.parse_args(argv)
    rows = [
        measure(n, args.iterations, args.policy, args.block_chars, breakdown=args.breakdown, max_candidates=k)
        for n in args.replicas or [16, 256]
        for k in args.max_candidates or [32]
    ]
    lines = [
        f"Decision time (PoolRouter.features + PoolRouter.route, policy {args.policy}, "
        f"{args.block_chars}-character blocks, "
        f"{rows[0]['prompt_tokens']}-token chat prompt of {rows[0]['chars']} characters, "
        f"{args.iterations} requests); wall clock, and this thread's CPU time",
        "",
        "best match: decisions whose replica holds as much of the prompt as the pool's best holder; "
        "excess: requests in flight on the busiest replica beyond the mean (8), averaged over decisions; "
        "decisions: a digest of the replicas chosen and the tokens they matched, in order (seeded: the "
        "same code decides the same; a pool larger than max_candidates samples at random)",
        "",
        "| replicas | max_candidates | p50 ms | p99 ms | max ms | CPU p50 ms | CPU p99 ms | best match "
        "| excess | decisions | target p99 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        target = TARGET_MS.get(int(r["replicas"]))
        verdict = "-" if target is None else f"<= {target} ms: {'met' if r['p99_ms'] <= target else 'MISSED'}"
        lines.append(
            f"| {r['replicas']} | {r['max_candidates'] or 'all'} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
            f"| {r['max_ms']:.3f} | {r['cpu_p50_ms']:.3f} | {r['cpu_p99_ms']:.3f} | {r['best_match']:.1%} "
            f"| {r['excess_inflight']:.1f} | {r['decisions']} | {verdict} |"
        )
    if args.breakdown:
        lines += [
            "",
            "Where the time goes: this thread's CPU time per request, mean / p99, in us "
            "(PoolRouter.route is serving + candidates + policy; candidates includes the prefix index match)",
            "",
            "| replicas | max_candidates | " + " | ".join(STAGES) + " |",
            "| ---: | ---: |" + " ---: |" * len(STAGES),
        ]
        for r in rows:
            cells = [f"{r[f'{stage}_mean_us']:.0f} / {r[f'{stage}_p99_us']:.0f}" for stage in STAGES]
            lines.append(f"| {r['replicas']} | {r['max_candidates'] or 'all'} | " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "decision_time.md").open("a") as fh:
            fh.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
