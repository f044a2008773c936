"""Admission and scheduling: priority classes, the queue, headroom on the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.config.base import Strict


class PriorityClass(Strict):
    name: str
    level: int = Field(description="Higher runs first")
    max_queue: int = Field(1000, ge=0)
    reserved_per_replica: int = Field(
        0, ge=0, description="In-flight slots per replica that lower classes may not take (kept for this one)"
    )


class SchedulerConfig(Strict):
    enabled: bool = True
    max_queue: int = Field(1000, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    classes: list[PriorityClass] = Field(
        default_factory=lambda: [
            PriorityClass(name="interactive", level=2),
            PriorityClass(name="default", level=1),
            PriorityClass(name="batch", level=0),
        ]
    )
    default_class: str = "default"
    sjf: bool = True
    aging_s: float = Field(10.0, gt=0, description="Wait after which a request outranks any shorter job")
    max_waiting_per_replica: int = Field(4, ge=0, description="Engine waiting queue above this: no headroom")
    max_kv_usage: float = Field(0.95, gt=0, le=1)
    max_inflight_tokens_per_replica: int | None = Field(None, gt=0)
    max_inflight_requests_per_replica: int = Field(256, gt=0)
    expected_output_tokens: int = Field(256, gt=0, description="Assumed when max_tokens is absent")
    max_expected_output_tokens: int = Field(
        2048, gt=0, description="A larger max_tokens counts as this much in the job-size estimate"
    )
    recheck_interval_s: float = Field(
        0.05, gt=0, description="While requests queue, re-check headroom this often (engine figures move)"
    )
    max_prompt_tokens: int | None = Field(None, gt=0, description="Per request, unless the tenant sets one")
    prompt_overflow: Literal["reject", "window"] = "reject"
    retry_after_s: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _default_known(self) -> SchedulerConfig:
        names = [c.name for c in self.classes]
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of {names}")
        return self
