"""Does kvgate's prefix index say what the engines found? A check after a run, medium by medium.

kvgate records, for each request it routes, the prompt tokens it believed the chosen replica held
on its GPU and, after those, in its CPU tier (`kvgate_prefix_matched_tokens_total{medium}`). The
engines count what they found: vLLM's `vllm:prefix_cache_hits` (GPU) and
`vllm:external_prefix_cache_hits` (tokens its KV connector loads: the CPU tier's, with
--kv-offloading-size). Over a run the two should agree; they are said to when kvgate's figure is
within `TOLERANCE` (10%) of the engines'. Where they do not, the index is wrong about the engines
(a CPU tier modelled bigger than it is, missed KV events, a tokenizer that differs), whatever the
latency figures say. Not for PD pools, whose decode replicas load the prefill's KV through the same
connector counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench import engine_metrics

TOLERANCE = 0.10
MATCHED = "kvgate_prefix_matched_tokens_total"
# The engine counters (bench.engine_metrics' names) each medium is checked against.
ENGINE_COUNTER = {"gpu": "prefix_cache_hits", "cpu": "external_cache_hit_tokens"}


def gateway_matched(gateways: Sequence[str], timeout_s: float = 2.0) -> dict[str, float]:
    """The tokens the gateways believed matched, by medium, summed over their pools and replicas."""
    return engine_metrics.gateway_counter(gateways, MATCHED, "medium", "gpu", timeout_s)


def agreement(matched: Mapping[str, float], engine: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per medium the engines counted: kvgate's tokens, the engines', their ratio and whether it is
    within TOLERANCE (a medium neither side saw any tokens on is left out). Empty when kvgate
    believed nothing anywhere: its policy never looked at prefixes (round_robin), nothing to check."""
    out: dict[str, dict[str, Any]] = {}
    if not any(matched.values()):
        return out
    for medium, key in ENGINE_COUNTER.items():
        counted = engine.get(key)
        believed = matched.get(medium, 0.0)
        if counted is None or (not counted and not believed):
            continue
        ratio = believed / counted if counted else None
        out[medium] = {
            "kvgate_tokens": believed,
            "engine_tokens": counted,
            "ratio": ratio,
            "agrees": ratio is not None and abs(ratio - 1.0) <= TOLERANCE,
        }
    return out
