"""The routing benchmark on a virtual clock: what the modelled engines alone give.

Same workload, seed, Poisson arrivals and simulated engines (`gateway.sim.engine.Engine`, profile
h200-llama3.1-8b, 8 GiB of KV each) as `python -m bench scenario routing`, with the real policy
classes deciding, but no HTTP, no gateway process, no CPU limits: every figure is the cost model's.
Rates and latencies are in simulated time (the benchmark's wall clock at --speedup 0.5 is half the
rate and twice the milliseconds). The gateway's approximate prefix index is stood in for by a
per-replica LRU of the groups routed there, sized from the KV capacity; engine load is "scraped"
every 0.25 s of simulated time (the gateway's 0.5 s at speedup 0.5).

    PYTHONPATH=. python results/routing/engine_model.py --rate 56 --rate 62 --seeds 4
"""

from __future__ import annotations

import argparse
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from bench.loadgen import LoadSpec, schedule
from bench.stats import percentile
from bench.workloads import make_workload
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.replica_speed import ReplicaSpeed
from gateway.policy import Candidate, Outcome, Policy, RequestFeatures
from gateway.prompt.tokens import get_tokenizer
from gateway.sim import protocol
from gateway.sim.engine import Engine, EngineConfig, Request
from gateway.sim.profiles import get_profile
from policies.prefix_affinity import PrefixAffinity, PrefixAffinityParams
from policies.radix_cache_aware import RadixCacheAware, RadixCacheAwareParams

REPLICAS = 4
KV_BYTES = 8 * 1024**3
SCRAPE_S = 0.25
PREFILL_TOKENS_PER_S = 40_000  # the scenario's 20000 at speedup 0.5, in simulated time
SYSTEM_TOKENS = 2048  # what a replica holding the group matches of each prompt
POLICIES = ("round_robin", "oracle", "radix_cache_aware", "prefix_affinity")


@dataclass
class View:
    """What a policy sees of a replica (gateway.policy.ReplicaView)."""

    name: str
    inflight_requests: int = 0
    inflight_tokens: int = 0
    remote_inflight_requests: int = 0  # one gateway: nobody else's
    remote_inflight_tokens: int = 0
    engine: EngineLoad = field(default_factory=EngineLoad)
    engine_fresh: bool = False
    url: str = ""
    role: str = "mixed"
    kind: str = "sim"
    device: str | None = None  # each simulated replica a whole GPU
    speed: ReplicaSpeed = field(default_factory=ReplicaSpeed)  # measured: nothing is, in this model
    available: bool = True
    kv_capacity_tokens: int | None = None


@dataclass
class Prompt:
    group: int
    ids: list[int]
    text: str
    max_tokens: int


@cache
def prompts(seed: int) -> list[Prompt]:
    """The full size of the routing scenario, tokenized as the simulator tokenizes chat."""
    tok = get_tokenizer()
    out = []
    for r in make_workload("shared-prefix").build(seed):
        ids = tok.encode(protocol.render_chat(r.messages, None))
        text = "".join(m["content"] for m in r.messages)
        out.append(Prompt(int((r.group or "g0")[1:]), ids, text, r.max_tokens))
    return out


def make_policy(name: str, clock: list[float]) -> Policy[Any] | None:
    now = clock.__getitem__
    if name == "prefix_affinity":
        params = PrefixAffinityParams(prefill_tokens_per_s=PREFILL_TOKENS_PER_S)
        return PrefixAffinity(params, clock=lambda: now(0))
    if name == "radix_cache_aware":
        return RadixCacheAware(RadixCacheAwareParams(), clock=lambda: now(0))
    return None


def _outcome(q: Request) -> Outcome:
    """A modelled request's end, as a policy hears it (times in simulated seconds)."""
    return Outcome(
        ok=True,
        status=200,
        error=None,
        ttft_s=q.ttft,
        e2e_s=(q.finished_at or 0.0) - q.arrival,
        prompt_tokens=q.prompt_len,
        cached_tokens=q.num_cached,
        attempts=1,
    )


def run(rate: float, policy_name: str, seed: int) -> dict[str, float]:
    reqs = prompts(seed)
    times = schedule(reqs, LoadSpec(mode="poisson", rate=rate, seed=seed))  # type: ignore[arg-type]
    profile = get_profile("h200-llama3.1-8b")
    engines = [Engine(EngineConfig(profile=profile, kv_cache_memory_bytes=KV_BYTES)) for _ in range(REPLICAS)]
    views = [View(f"r{i}") for i in range(REPLICAS)]
    clock = [0.0]
    policy = make_policy(policy_name, clock)
    groups_held = engines[0].pool.num_blocks * engines[0].block_size // len(reqs[0].ids)
    index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(REPLICAS)]
    live: list[list[tuple[Request, RequestFeatures]]] = [[] for _ in range(REPLICAS)]
    sent: list[tuple[Request, int]] = []
    turn = itertools.count()
    next_scrape = 0.0
    for n, (p, t) in enumerate(zip(reqs, times, strict=False)):
        for e in engines:
            e.advance_to(t)
        clock[0] = t
        for v, mine in zip(views, live, strict=True):
            if policy is not None:
                for q, f in mine:
                    if q.finished_at is not None:
                        policy.on_complete(f, v, _outcome(q))
            mine[:] = [(q, f) for q, f in mine if q.finished_at is None]
            v.inflight_requests = len(mine)
        if t >= next_scrape:
            for v, e in zip(views, engines, strict=True):
                v.engine = EngineLoad(waiting=e.num_waiting, running=len(e.running), updated_at=t)
                v.engine_fresh = True
            next_scrape = t + SCRAPE_S
        f = RequestFeatures(str(n), "m", "p", "chat", prompt_tokens=len(p.ids), text=p.text)
        if policy_name == "round_robin":
            k = next(turn) % REPLICAS
        elif policy_name == "oracle":
            k = p.group % REPLICAS
        else:
            assert policy is not None
            cands = [
                Candidate(v, 0, SYSTEM_TOKENS if p.group in index[i] else 0) for i, v in enumerate(views)
            ]
            k = int(policy.rank(f, cands)[0].replica.name[1:])
            policy.on_routed(f, views[k])
        index[k][p.group] = None
        index[k].move_to_end(p.group)
        while len(index[k]) > groups_held:
            index[k].popitem(last=False)
        q = Request(str(n), p.ids, p.max_tokens)
        engines[k].add_request(q, at=t)
        sent.append((q, k))
        live[k].append((q, f))
    for e in engines:
        e.run_until_idle()
    ttft = [(q.ttft or 0.0) * 1000 for q, _ in sent]
    per_replica = [sum(1 for _, k in sent if k == i) for i in range(REPLICAS)]
    return {
        "p50": percentile(ttft, 50) or 0.0,
        "p95": percentile(ttft, 95) or 0.0,
        "p99": percentile(ttft, 99) or 0.0,
        "hit": sum(q.num_cached for q, _ in sent) / sum(q.prompt_len for q, _ in sent),
        "misses": sum(1 for q, _ in sent if q.num_cached < q.prompt_len // 2),
        "served": len(sent) / max(q.finished_at or 0.0 for q, _ in sent),
        "spread": max(per_replica) * REPLICAS / len(sent),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, action="append", required=True, help="simulated req/s")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--policy", action="append", choices=POLICIES, help="default: all")
    args = ap.parse_args()
    print("| rate (sim req/s) | seed | policy | TTFT p50 | p95 | p99 | hit | misses | served | spread |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rate in args.rate:
        for seed in range(args.seeds):
            for name in args.policy or POLICIES:
                m = run(rate, name, seed)
                print(
                    f"| {rate:g} | {seed} | {name} | {m['p50']:.1f} | {m['p95']:.1f} | {m['p99']:.1f} | "
                    f"{m['hit']:.1%} | {m['misses']:.0f} | {m['served']:.1f} | {m['spread']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
