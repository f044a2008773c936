"""The control plane's listener, state shared by several gateways, and telemetry."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.base import Strict


class ControlConfig(Strict):
    """The control plane: the admin API (and its OpenAPI schema and docs page) on a listener of its
    own, never on the data plane's port."""

    host: str = Field("127.0.0.1", description="Address the admin API listens on")
    port: int = Field(
        9001, ge=0, le=65535, description="The admin API's port (0: a free port, picked at start)"
    )
    admin_key: str | None = Field(
        None, description="Bearer key every /admin route needs; unset = no control listener at all"
    )
    max_connections: int = Field(
        32, gt=0, description="Connections served at once; beyond it, 503 until one closes"
    )
    idle_timeout_s: float = Field(
        5.0, gt=0, description="A connection silent this long is closed, before its first request too"
    )
    header_timeout_s: float = Field(
        5.0, gt=0, description="A request head must be whole this long after its connection or first byte"
    )
    max_connections_per_address: int = Field(
        8, gt=0, description="Connections from one peer address (its longest waiting one gives way)"
    )
    body_deadline_s: float = Field(
        10.0, gt=0, description="A request body must be whole this long after its head (408)"
    )


class StateConfig(Strict):
    """State shared by several gateway instances (load, prefix index, weights, rate limits)."""

    backend: Literal["memory", "redis"] = Field(
        "memory", description="memory: this instance's own; redis: shared by every instance using it"
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="The Redis server (backend redis)")
    key_prefix: str = Field(
        "kvgate", description="Prefix of every Redis key: instances sharing it share state"
    )
    sync_interval_s: float = Field(0.2, gt=0, description="How often an instance syncs with Redis")
    instance_ttl_s: float = Field(
        10.0, gt=0, description="An instance silent this long no longer counts (its load is dropped)"
    )


class TelemetryConfig(Strict):
    """Metrics and traces."""

    metrics: bool = Field(True, description="Serve Prometheus metrics at /metrics")
    tracing: bool = Field(
        False, description="OpenTelemetry spans per request, exported as the OTEL_* variables say"
    )
    service_name: str = Field("kvgate", description="The traces' service.name (OTEL_SERVICE_NAME wins)")
