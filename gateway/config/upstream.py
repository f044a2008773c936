"""The engines as the gateway reaches them: their URLs, connections, retries, health checks,
circuit breaking and load scrapes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field

from gateway.config.base import Strict


# -- engine URLs, as the settings accept them and the transports use them ---------------------------
@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str
    # Derived once: targets are cached (parse_target), and every request reads these.
    origin: tuple[str, str, int] = field(init=False)
    host_header: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "origin", (self.scheme, self.host, self.port))
        host = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        object.__setattr__(self, "host_header", host)

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host_header}{self.path}"


_VISIBLE = re.compile(r"[\x21-\x7e]+")


@lru_cache(maxsize=4096)
def parse_target(url: str) -> Target:
    """An engine URL as the transports use it; ValueError for what no transport can send to."""
    if not _VISIBLE.fullmatch(url):  # urlsplit would silently drop a CR or LF
        raise ValueError(f"engine URL has spaces or control characters: {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine URLs are http:// or https://, not {parts.scheme!r}: {url}")
    if not parts.hostname:
        raise ValueError(f"engine URL without a host: {url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)  # ValueError when out of range
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, parts.hostname, port, path)


class UpstreamTLS(Strict):
    """TLS towards https:// engines."""

    verify: bool = Field(
        True, description="Check engines' certificates and host names; false only on purpose"
    )
    ca_file: str | None = Field(None, description="PEM bundle to trust instead of the system's CAs")


class UpstreamConfig(Strict):
    """How the gateway talks to engines: its HTTP client, timeouts and bounds on what engines send."""

    transport: Literal["http1", "aiohttp"] = Field(
        "http1", description="http1: kvgate's own client (fast); aiohttp: aiohttp's client (fallback)"
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Longest wait to open a connection to an engine")
    first_byte_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for an engine's response headers, waiting for a free connection included",
    )
    idle_timeout_s: float = Field(
        120.0, gt=0, description="Longest silence of an engine between two body chunks"
    )
    max_connections: int = Field(
        4096, gt=0, description="Connections per engine host:port, idle ones included"
    )
    max_response_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Largest non-streamed engine answer (streams are relayed as they come)",
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest response head (status line, headers)"
    )
    max_headers: int = Field(100, ge=8, description="Most headers in one engine response")
    reuse_unverified_connections: bool = Field(
        False,
        description="Reuse connections to engines that do not echo X-Request-Id (a late stray answer"
        " from such an engine could then reach another request)",
    )
    tls: UpstreamTLS = Field(default_factory=UpstreamTLS, description="TLS towards https:// engines")


class RetryConfig(Strict):
    """Retries on another replica, before the answer's first byte reached the client."""

    max_attempts: int = Field(3, ge=1, description="Total tries, first included")
    backoff_initial_s: float = Field(
        0.02, ge=0, description="Wait before the first retry, doubled for each next one (with jitter)"
    )
    backoff_max_s: float = Field(0.5, ge=0, description="Longest wait between two tries")
    budget_ratio: float = Field(
        0.2, ge=0, description="Retries allowed as a fraction of recent requests (plus budget_floor)"
    )
    budget_floor: int = Field(
        10, ge=0, description="Retries always allowed whatever the traffic, refilled over budget_refill_s"
    )
    budget_refill_s: float = Field(
        10.0, ge=0, description="How long the budget_floor takes to come back once spent (0: never)"
    )
    retry_statuses: list[int] = Field(
        default_factory=lambda: [429, 502, 503, 504],
        description="Engine answers tried again on another replica (connection failures always are)",
    )


class HealthConfig(Strict):
    """Active health checks of every replica."""

    enabled: bool = Field(True, description="Check every replica's health path in the background")
    interval_s: float = Field(2.0, gt=0, description="Pause between two rounds of checks")
    timeout_s: float = Field(1.0, gt=0, description="A check not answered 200 within this fails")
    failure_threshold: int = Field(2, ge=1, description="Failed checks in a row that take a replica out")
    success_threshold: int = Field(1, ge=1, description="Passed checks in a row that bring it back")
    path: str = Field("/health", description="Path checked on each engine (GET, 200 = healthy)")


class BreakerConfig(Strict):
    """Each replica's circuit breaker, fed by the requests sent to it."""

    failure_threshold: int = Field(5, ge=1, description="Consecutive failures that open the circuit")
    open_s: float = Field(10.0, gt=0, description="How long an open circuit rejects before a probe")


class ScrapeConfig(Strict):
    """Engine load (running, waiting, KV cache use) read from each replica's metrics."""

    interval_s: float = Field(0.5, gt=0, description="How often each replica's load is read")
    stale_after_s: float = Field(
        3.0, gt=0, description="Older engine figures are not trusted: routing and admission go without them"
    )
