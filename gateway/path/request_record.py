"""What happened to one request, filled in along its path and handed to observers at its end.

Observers (metrics, access log, traces, rollout statistics) read the record; none of them
sits in the proxy's code path, so adding one never touches the hot path's logic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.prompt.tokens import engine_prompt_tokens, usage_figure


@dataclass(slots=True)
class RequestRecord:
    request_id: str  # the client's X-Request-Id when it sent a usable one, else engine_request_id
    endpoint: str
    engine_request_id: str = ""
    # False for /tokenize and /detokenize: logged and counted, kept out of latency, routing and
    # rollout figures (and of the pools' traffic that autoscaling reads).
    inference: bool = True  # the id engines see, made by the gateway
    started: float = field(default_factory=time.perf_counter)
    model: str | None = None  # the name the client asked for
    pool: str | None = None
    replica: str | None = None
    tenant: str | None = None
    priority_class: str | None = None
    stream: bool = False
    prompt_tokens: int = 0
    prompt_chars: int = 0  # characters of the prompt text the gateway hashed
    engine_prompt_tokens: int | None = None  # the engine's own count (its usage figures), when it gave one
    engine_cached_tokens: int | None = None  # of them, found in its prefix cache (usage), when it said
    engine_output_tokens: int | None = None  # usage.completion_tokens, when it gave them
    matched_tokens: int = 0  # prompt tokens the chosen replica was believed to hold on its GPU
    cpu_matched_tokens: int = 0  # and right after those, in CPU memory (loaded, not recomputed)
    route_reason: str | None = None  # why the policy chose the replica (e.g. "cache_hit", "spill")
    # A PD pool's hand-off: "handoff" (prefilled elsewhere), "skipped" (the decode replica held
    # enough of the prompt), "decode_only" (no prefill replica free, the prefill leg or the
    # transferred KV failed: the decode replica prefilled it all).
    pd: str | None = None
    status: int = 0
    error_code: str | None = None
    shed_reason: str | None = None
    retries: int = 0
    # Sent again by the transport on a fresh connection (a stale idle one, or an answer that was
    # not its own): the engine may have run it twice.
    resent: int = 0
    resumed: list[str] = field(default_factory=list)  # per continuation: "<reason>@<replica it broke on>"
    resume_blocked: str | None = None  # why an answer that failover followed could no longer be continued
    queued_s: float = 0.0
    sent_at: float | None = None  # perf_counter when the last attempt was sent to its replica
    first_byte_at: float | None = None  # perf_counter when the first body byte went to the client
    ended: float | None = None
    client_disconnected: bool = False
    completed: bool = False  # a stream cut by its client had been relayed through its last event

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_byte_at is None else self.first_byte_at - self.started

    @property
    def duration_s(self) -> float:
        return (self.ended or time.perf_counter()) - self.started


Observer = Callable[[RequestRecord], None]


# Found in a usage chunk: a substring test per streamed chunk, so that only those are read.
USAGE_MARK = b'"prompt_tokens":'


def read_usage(body: bytes, rec: RequestRecord) -> None:
    """The engine's usage figures in a body or its usage chunk, kept where present."""
    rec.engine_prompt_tokens = engine_prompt_tokens(body) or rec.engine_prompt_tokens
    cached = usage_figure(body, b"cached_tokens")  # 0 is a figure: a cold prompt
    rec.engine_cached_tokens = rec.engine_cached_tokens if cached is None else cached
    rec.engine_output_tokens = usage_figure(body, b"completion_tokens") or rec.engine_output_tokens
