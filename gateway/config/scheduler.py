"""Admission and scheduling: priority classes, the queue, headroom on the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.config.base import Strict


class PriorityClass(Strict):
    """A priority class: what `x-priority` (or the body's `priority`) names."""

    name: str = Field(description="The class's name, as requests and tenants' max_priority give it")
    level: int = Field(description="Higher runs first")
    max_queue: int = Field(
        1000, ge=0, description="Requests of this class queued per pool at once (429 beyond)"
    )
    reserved_per_replica: int = Field(
        0, ge=0, description="In-flight slots per replica that lower classes may not take (kept for this one)"
    )


class SchedulerConfig(Strict):
    """Admission and order: per pool, requests wait in a queue until a replica has headroom."""

    enabled: bool = Field(
        True,
        description="Queue and admit by headroom; false: every request is sent at once (rate limits stay)",
    )
    max_queue: int = Field(
        1000,
        ge=0,
        description="Requests queued per pool, all classes; a full queue sheds its lowest class (429)",
    )
    queue_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait in the queue, then 503 with Retry-After"
    )
    classes: list[PriorityClass] = Field(
        default_factory=lambda: [
            PriorityClass(name="interactive", level=2),
            PriorityClass(name="default", level=1),
            PriorityClass(name="batch", level=0),
        ],
        description="The priority classes, each with its level, queue bound and reserved slots",
    )
    default_class: str = Field("default", description="The class of a request that names none")
    sjf: bool = Field(
        True,
        description="Within a class, the smallest job (uncached prompt + expected output) first; false: FIFO",
    )
    aging_s: float = Field(10.0, gt=0, description="Wait after which a request outranks any shorter job")
    max_waiting_per_replica: int = Field(4, ge=0, description="Engine waiting queue above this: no headroom")
    max_kv_usage: float = Field(0.95, gt=0, le=1, description="Engine KV cache use above this: no headroom")
    max_inflight_tokens_per_replica: int | None = Field(
        None, gt=0, description="Prompt tokens of the requests in flight on one replica; unset: no bound"
    )
    max_inflight_requests_per_replica: int = Field(
        256, gt=0, description="Requests in flight on one replica (the gateway's count)"
    )
    expected_output_tokens: int = Field(256, gt=0, description="Assumed when max_tokens is absent")
    max_expected_output_tokens: int = Field(
        2048, gt=0, description="A larger max_tokens counts as this much in the job-size estimate"
    )
    recheck_interval_s: float = Field(
        0.05, gt=0, description="While requests queue, re-check headroom this often (engine figures move)"
    )
    max_prompt_tokens: int | None = Field(None, gt=0, description="Per request, unless the tenant sets one")
    prompt_overflow: Literal["reject", "window"] = Field(
        "reject",
        description="A prompt over max_prompt_tokens is refused (400) or trimmed to a window that keeps "
        "the system prompt and the newest turns",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After (seconds) of a shed request's 429 or 503")

    @model_validator(mode="after")
    def _default_known(self) -> SchedulerConfig:
        names = [c.name for c in self.classes]
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of {names}")
        return self
