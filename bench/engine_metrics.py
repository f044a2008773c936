"""The engines' own counters after a run (vLLM metric names, which the simulator speaks too).

The client's cache-hit rate comes from usage fields; the engines' prefix-cache counters and
preemptions are a second opinion from the other end, summed over the fleet. A simulator serving
LoRA adapters also reports how often it swapped an adapter into a GPU slot and read one from disk
(`/sim/state`; vLLM exposes no such counter, only the adapters in its running batch).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:num_preemptions": "preemptions",
}
LORA_COUNTERS = ("lora_swaps", "lora_disk_loads")
# The KV connector's figures, by sample name: prompt tokens loaded rather than computed (from the
# CPU tier with --kv-offloading-size; on a PD decode leg, from the prefill replica), and a decode
# replica's NIXL transfers.
TRANSFER_SAMPLES = {
    "vllm:external_prefix_cache_hits_total": "external_cache_hit_tokens",
    "vllm:nixl_xfer_time_seconds_count": "kv_transfers",
    "vllm:nixl_xfer_time_seconds_sum": "kv_transfer_s",
    "vllm:nixl_bytes_transferred_sum": "kv_transfer_bytes",
    "vllm:nixl_num_failed_transfers_total": "kv_transfers_failed",
    # The CPU tier's copies (OffloadingConnector): loads are transfer jobs, one per request that hit.
    "vllm:kv_offload_load_size_count": "cpu_loads",
    "vllm:kv_offload_load_bytes_total": "cpu_load_bytes",
    "vllm:kv_offload_store_bytes_total": "cpu_store_bytes",
}


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """One engine's counters; empty when it has no /metrics or none of these names."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout_s) as resp:
            body = resp.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    # Go by sample names: depending on how the TYPE lines are laid out, the parser files a
    # `<name>_total` sample under `<name>` or under a family of its own.
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            key = COUNTERS.get(sample.name.removesuffix("_total")) if sample.name.endswith("_total") else None
            key = key or TRANSFER_SAMPLES.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + sample.value
    return out


def sim_lora(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """A simulator's adapter swaps and disk reads; empty when it is no simulator or serves no LoRA."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/sim/state", timeout=timeout_s) as resp:
            lora = json.loads(resp.read()).get("lora")
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return {}
    if not isinstance(lora, dict):
        return {}
    return {"lora_swaps": float(lora.get("swaps", 0)), "lora_disk_loads": float(lora.get("disk_loads", 0))}


def fleet_counters(urls: Sequence[str]) -> dict[str, Any]:
    """Counters summed over the engines, with the engines' own prefix-cache hit rate."""
    per_engine = [scrape(u) | sim_lora(u) for u in urls]
    if not any(per_engine):
        return {}
    keys = _keys({k: 0 for e in per_engine for k in e})
    return _with_hit_rate({key: sum(e.get(key, 0.0) for e in per_engine) for key in keys})


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a run added to long-running engines' counters (both from `fleet_counters`)."""
    if not after:
        return {}
    return _with_hit_rate({key: after[key] - before.get(key, 0.0) for key in _keys(after)})


def _keys(counters: dict[str, Any]) -> list[str]:
    """The counters summed: vLLM's, and the simulator's LoRA figures where it reports them."""
    transfers = [k for k in TRANSFER_SAMPLES.values() if k in counters]
    return [*COUNTERS.values(), *transfers, *(LORA_COUNTERS if "lora_swaps" in counters else ())]


def _with_hit_rate(total: dict[str, Any]) -> dict[str, Any]:
    queries = total["prefix_cache_queries"]
    total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else None
    # Prompt tokens neither on the GPU nor loaded by the connector: prefilled.
    total["recomputed_tokens"] = (
        queries - total["prefix_cache_hits"] - total.get("external_cache_hit_tokens", 0.0)
    )
    return total


def gateway_counter(
    gateways: Sequence[str], name: str, label: str, default: str | None = None, timeout_s: float = 2.0
) -> dict[str, float]:
    """The gateways' samples of counter `name`, summed by the value of `label` (a sample without it
    counts under `default`; without a default it is an error). A gateway that does not answer counts
    nothing."""
    out: dict[str, float] = {}
    for url in gateways:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout_s) as resp:
                body = resp.read().decode()
        except (urllib.error.URLError, OSError, ValueError):
            continue
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == name:
                    key = sample.labels[label] if default is None else sample.labels.get(label, default)
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def gateway_pd_paths(gateways: Sequence[str], timeout_s: float = 2.0) -> dict[str, float]:
    """How the gateways ran a PD pool's requests (kvgate_pd_requests_total by path), summed."""
    return gateway_counter(gateways, "kvgate_pd_requests_total", "path", timeout_s=timeout_s)
