"""Prometheus text exposition for one replica, with vLLM's (or SGLang's) metric names.

Hand-written rather than prometheus_client so that several replicas in one process keep separate registries
and an observation costs a few list operations.
"""

from __future__ import annotations

from bisect import bisect_left

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0)


class Histogram:
    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect_left(self.buckets, v)] += n
        self.sum += v * n
        self.count += n

    def render(self, name: str, labels: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        acc = 0
        for le, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {acc}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum{{{labels}}} {self.sum}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines


class EngineMetrics:
    __slots__ = (
        "decode_time",
        "e2e",
        "external_prefix_cache_hits",
        "external_prefix_cache_queries",
        "generation_tokens",
        "itl",
        "kv_transfer_time",
        "num_preemptions",
        "prefill_time",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_tokens",
        "queue_time",
        "requests_finished",
        "ttft",
    )

    def __init__(self) -> None:
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The KV connector's lookups (a decode leg's transfer, the CPU tier): tokens past the GPU hit,
        # and those it loaded.
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.kv_transfer_time = Histogram()  # per PD transfer, as vllm:nixl_xfer_time_seconds
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.requests_finished = 0
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.queue_time = Histogram()
        self.prefill_time = Histogram()  # scheduled -> first token
        self.decode_time = Histogram()  # first token -> finished
        self.itl = Histogram(ITL_BUCKETS)

    def as_dict(self) -> dict[str, int]:
        return {
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "external_prefix_cache_queries": self.external_prefix_cache_queries,
            "external_prefix_cache_hits": self.external_prefix_cache_hits,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "num_preemptions": self.num_preemptions,
            "requests_finished": self.requests_finished,
        }
