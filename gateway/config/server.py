"""The data plane's listener and its clients: limits on connections, bodies and work, tenants."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.base import Strict


class TenantConfig(Strict):
    """A client with its own key, priority cap and limits."""

    name: str = Field(description="The tenant's name in the access log and in rate-limit keys")
    api_key: str = Field(description="Bearer key that identifies this tenant")
    max_priority: str | None = Field(None, description="Highest priority class this tenant may ask for")
    requests_per_s: float | None = Field(
        None, gt=0, description="Rate limit in requests per second (429 beyond it); unset: none"
    )
    tokens_per_min: int | None = Field(
        None, gt=0, description="Rate limit in prompt plus expected output tokens per minute; unset: none"
    )
    max_prompt_tokens: int | None = Field(
        None, gt=0, description="Longest prompt in tokens, instead of scheduler.max_prompt_tokens"
    )
    prompt_overflow: Literal["reject", "window"] = Field(
        "reject",
        description="A longer prompt is refused (400) or trimmed to a window that keeps the system "
        "prompt and the newest turns",
    )
    max_concurrent_requests: int | None = Field(
        None, gt=0, description="Requests being sent or prepared at once (server.max_requests_per_tenant)"
    )


class ServerConfig(Strict):
    """The data plane: the OpenAI API's listener and the limits it puts on clients."""

    host: str = Field("127.0.0.1", description="Address the API listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="The API's port (0: a free port, picked at start)")
    api_keys: list[str] = Field(default_factory=list, description="Client keys; empty = no auth")
    admin_key: str | None = Field(
        None, description="Deprecated: use control.admin_key (the admin API has its own listener)"
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest request body, counted after decompression"
    )
    max_json_depth: int = Field(
        64, ge=2, le=200, description="Deepest nesting of arrays and objects a request body may have"
    )
    body_timeout_s: float = Field(30.0, gt=0, description="Longest pause while a client sends its body")
    body_deadline_s: float = Field(120.0, gt=0, description="Longest time a client may take to send its body")
    max_requests_per_tenant: int = Field(
        1000,
        gt=0,
        description="One key's requests from head to answer at once (a tenant's, or each plain API"
        " key's; bodies being sent, queued); keep it below max_connections so that one key cannot hold"
        " every connection",
    )
    max_n: int = Field(128, ge=1, description="Most choices (`n`) one request may ask for")
    max_prompts: int = Field(256, ge=1, description="Most prompts in one completions batch")
    max_sequences: int = Field(
        1024,
        ge=1,
        description="Most sequences one request may have engines generate: its prompts times its choices"
        " (`n`, or `best_of` where larger)",
    )
    max_inputs: int = Field(
        2048, ge=1, description="Most inputs of one embeddings/pooling/classify request (documents: rerank)"
    )
    offload_body_bytes: int = Field(
        128 * 1024, ge=0, description="Larger bodies are canonicalized and hashed in a worker thread"
    )
    grace_period_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long requests in flight get to finish before the exit"
    )
    shutdown_delay_s: float = Field(
        0.0,
        ge=0,
        description="On SIGTERM, fail /ready and keep serving this long before closing the listener, so a "
        "load balancer (a Kubernetes Service) stops sending first; grace_period_s starts after it",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Longest wait for a new connection's first request head"
    )
    keepalive_timeout_s: float = Field(
        75.0, gt=0, description="An idle connection is closed after this long between requests"
    )
    max_connections: int = Field(
        10_000, gt=0, description="Client connections; lowered at start if file descriptors cannot cover it"
    )
    reserved_connections: int = Field(
        32, ge=0, description="Beyond max_connections: answered for /health, /ready and /live only"
    )
    impl: Literal["httptools", "aiohttp"] = Field(
        "httptools",
        description="The data plane's HTTP server: kvgate's lean one on llhttp, or aiohttp's; same routes, "
        "limits and behaviour",
    )
    access_log: bool = Field(True, description="One log line per request (no prompt text)")
    log_json: bool = Field(False, description="Log lines as JSON objects instead of text")
    log_level: str = Field("info", description="debug, info, warning or error")
    ready: Literal["any", "all"] | list[str] = Field(
        "any",
        description="When /ready answers 200: `any` pool has a healthy replica, `all` pools do, or "
        "every pool of a list does (never while draining)",
    )
