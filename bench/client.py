"""The streaming benchmark client: sends one request and measures it from the client's side.

Timing uses time.perf_counter(): TTFT is from the moment the request is handed to aiohttp to
the first chunk carrying generated text; inter-token latencies are the gaps between later
text-carrying chunks. Token counts come from the final usage chunk (stream_options.include_usage).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from bench.workloads import BenchRequest

STATUS_CONNECT_ERROR = 0  # no HTTP status: connection refused/reset
STATUS_TIMEOUT = -1  # gave up waiting (request timeout or the run's drain deadline)

Api = Literal["chat", "completions"]


@dataclass(slots=True)
class RequestRecord:
    index: int
    kind: str
    priority: str | None
    group: str | None
    target: str
    status: int = STATUS_CONNECT_ERROR
    error: str | None = None
    replica: str | None = None  # x-kvgate-replica, or the target URL when benchmarking engines directly
    pool: str | None = None  # x-kvgate-pool
    scheduled: float = 0.0  # seconds since run start: when the schedule wanted it sent
    ready: float = 0.0  # when it could be sent (after the session turn it depends on)
    sent: float | None = None  # when it was handed to the HTTP client (None: never sent)
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    warmup: bool = False
    retry_after: str | None = None  # the Retry-After header of a refused request (429/503)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ClientOptions:
    model: str
    api: Api = "chat"
    ignore_eos: bool = True  # vLLM/SGLang/sim extension: generate exactly max_tokens
    timeout_s: float = 600.0
    api_key: str | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)


def request_body(req: BenchRequest, opts: ClientOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.model or opts.model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if opts.api == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt_text()
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


def request_headers(req: BenchRequest, opts: ClientOptions) -> dict[str, str]:
    headers = {"content-type": "application/json", **opts.extra_headers}
    if opts.api_key:
        headers["authorization"] = f"Bearer {opts.api_key}"
    if req.priority:
        headers["x-priority"] = req.priority
    if req.group:
        headers["x-kvgate-group"] = req.group
    return headers


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            parts.append(delta.get("content") or delta.get("reasoning_content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    req: BenchRequest,
    opts: ClientOptions,
    record: RequestRecord,
    t0: float,
) -> RequestRecord:
    """Send `req` to `base_url`, filling `record` (times relative to the run's start `t0`)."""
    path = "/v1/chat/completions" if opts.api == "chat" else "/v1/completions"
    record.target = base_url
    start = time.perf_counter()
    record.sent = start - t0
    last_token: float | None = None
    chunks_with_text = 0
    try:
        async with session.post(
            base_url.rstrip("/") + path,
            data=orjson.dumps(request_body(req, opts)),
            headers=request_headers(req, opts),
            timeout=aiohttp.ClientTimeout(total=opts.timeout_s),
        ) as resp:
            record.status = resp.status
            record.replica = resp.headers.get("x-kvgate-replica") or base_url
            record.pool = resp.headers.get("x-kvgate-pool")
            if resp.status != 200:
                record.retry_after = resp.headers.get("retry-after")
                record.error = _error_message(await resp.read())
                record.e2e = time.perf_counter() - start
                return record
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    record.error = _error_message(payload)
                    break
                now = time.perf_counter()
                if _chunk_text(chunk):
                    chunks_with_text += 1
                    if last_token is None:
                        record.ttft = now - start
                    else:
                        record.itls.append(now - last_token)
                    last_token = now
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
            record.e2e = time.perf_counter() - start
            if not record.output_tokens:
                record.output_tokens = chunks_with_text
            if record.error is None and record.ttft is None:
                record.error = "stream ended without any generated text"
    except TimeoutError:
        record.status, record.error = STATUS_TIMEOUT, f"timed out after {opts.timeout_s} s"
    except asyncio.CancelledError:
        record.status, record.error = STATUS_TIMEOUT, "cancelled at the run's drain deadline"
        raise
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _error_message(body: bytes) -> str:
    try:
        err = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode(errors="replace")
    if isinstance(err, dict):
        inner = err.get("error", err)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner)[:200]
        return str(inner)[:200]
    return str(err)[:200]
