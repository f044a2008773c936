"""How bytes move to and from engines on the hot path, whatever the transport: the per-host
connection cap, the timeouts, bounded reads, and one classification of what went wrong.

Where a request goes is decided elsewhere (proxy); this module opens a request on the
configured transport (gateway/path/transports/), yields body chunks under an idle timeout, and
turns every failure into an `UpstreamError` that says what the client should get, whether
another try may help, whether it counts against the replica, and how many times the
request reached an engine.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Mapping

from gateway.config import Target, UpstreamConfig, parse_target
from gateway.errors import GatewayError
from gateway.path.deadlines import SharedTimeout
from gateway.path.transports import make_transport
from gateway.path.transports.base import (
    ConnectError,
    DisconnectedError,
    HostSlots,
    InvalidHeaderError,
    Response,
    TransportError,
)

# Error bodies are read only to tell the client what the engine said.
ERROR_BODY_LIMIT = 64 * 1024


class UpstreamError(Exception):
    """The engine gave no usable answer.

    `status`/`code`: what the client gets. `retryable`: nothing was relayed and another try
    (on this or another replica) may succeed. `replica_fault`: a transport failure, held
    against the replica by its circuit breaker (see gateway/path/claim.py for the rule). `sent`:
    how many times the request reached an engine in this attempt (a generation may reach
    engines at most `retry.max_attempts` times in all). The message, for the logs, may name the
    engine's address; `public`, what clients read with the replica's name, never does."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        code: str = "upstream_unreachable",
        retryable: bool = False,
        replica_fault: bool = True,
        sent: int = 1,
        error_type: str = "upstream_error",
        public: str | None = None,
    ) -> None:
        super().__init__(message)
        self.public = public or message
        self.status = status
        self.code = code
        self.retryable = retryable
        self.replica_fault = replica_fault
        self.sent = sent
        self.error_type = error_type

    def client_message(self, replica: str) -> str:
        return f"replica {replica}: {self.public}"

    def gateway_error(self, replica: str) -> GatewayError:
        return GatewayError(self.status, self.client_message(replica), self.error_type, self.code)


def _classify(exc: TransportError, *, head: bool, target: Target | None = None) -> UpstreamError:
    """A transport failure; `head`: before the answer's head (nothing relayed, may be retried).
    `target`: the engine's address, which a connect failure's text names and a client must not read."""
    public = None
    if isinstance(exc, ConnectError):
        code = "upstream_unreachable"
        public = _unnamed(str(exc), target) if target is not None else "cannot connect to the engine"
    elif isinstance(exc, DisconnectedError):
        code = "upstream_disconnected"
    else:
        code = "upstream_bad_response"
    return UpstreamError(str(exc), code=code, retryable=head, sent=exc.sent, public=public)


def _unnamed(text: str, target: Target) -> str:
    """`text` with the engine's address replaced by "the engine", or a plain phrase if the address
    shows in another form too."""
    text = text.replace(target.host_header, "the engine")
    return "cannot connect to the engine" if target.host in text else text


def _ready(resp: Response) -> bytes | None:
    """The body's piece that has arrived already (b"": the end); None when there is none yet."""
    try:
        return resp.read_nowait()
    except TransportError as exc:
        raise _classify(exc, head=False) from None


def _too_large(limit: int) -> UpstreamError:
    # The engine answered; a big answer is something any client can ask for (n, logprobs).
    return UpstreamError(
        f"engine response exceeds {limit} bytes",
        code="upstream_response_too_large",
        replica_fault=False,
    )


class Upstream:
    def __init__(self, cfg: UpstreamConfig) -> None:
        self.cfg = cfg
        self.transport = make_transport(cfg)
        self.slots = HostSlots(cfg.max_connections)
        self._timeouts: dict[float, SharedTimeout] = {}

    def _timeout(self, seconds: float) -> SharedTimeout:
        shared = self._timeouts.get(seconds)
        if shared is None:
            shared = self._timeouts[seconds] = SharedTimeout(seconds)
        return shared

    async def close(self) -> None:
        await self.transport.close()

    async def open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
        *,
        resend: bool = True,
    ) -> Response:
        """Send the request and wait for the response head, a free connection included, within
        `first_byte_timeout_s`. `resend`: may a stale keep-alive connection cost one silent resend."""
        target = parse_target(url)
        fbt = self.cfg.first_byte_timeout_s
        slot = self.slots.try_acquire(target.origin)
        try:
            # One deadline for the free connection and the answer's head.
            async with self._timeout(fbt).wait():
                if slot is None:
                    slot = await self.slots.acquire(target.origin)
                return await self.transport.request(
                    method, target, body or b"", headers, slot=slot, resend=resend
                )
        except BaseException as exc:
            if slot is None:
                if isinstance(exc, TimeoutError):
                    raise UpstreamError(
                        f"all {self.cfg.max_connections} connections to {target.host_header} stayed busy"
                        f" for {fbt:g} s (upstream.max_connections)",
                        public=f"all {self.cfg.max_connections} connections to the engine stayed busy"
                        f" for {fbt:g} s (upstream.max_connections)",
                        status=503,
                        code="upstream_busy",
                        replica_fault=False,
                        sent=0,
                        error_type="service_unavailable",
                    ) from None
                raise
            slot.release()
            if isinstance(exc, TimeoutError):
                raise UpstreamError(
                    f"no response from the engine within {fbt:g} s", status=504, code="upstream_timeout"
                ) from None
            if isinstance(exc, TransportError):
                raise _classify(exc, head=True, target=target) from None
            if isinstance(exc, InvalidHeaderError):
                raise UpstreamError(
                    str(exc),
                    status=400,
                    code="invalid_header",
                    replica_fault=False,
                    sent=0,
                    error_type="invalid_request_error",
                ) from None
            raise

    async def chunks(self, resp: Response) -> AsyncIterator[bytes]:
        """The response body as it arrives, failing if the engine goes quiet for too long."""
        while True:
            chunk = _ready(resp)
            if chunk is None:
                chunk = await self._next(resp)
            if not chunk:
                return
            yield chunk

    async def _next(self, resp: Response) -> bytes:
        """The body's next piece, within `idle_timeout_s`. What has arrived already (all of a
        small answer, as a rule) is `_ready`'s, without a timeout."""
        idle = self.cfg.idle_timeout_s
        try:
            async with self._timeout(idle).wait():
                return await resp.readany()
        except TimeoutError:
            raise UpstreamError(
                f"engine sent nothing for {idle:g} s", status=504, code="upstream_timeout"
            ) from None
        except TransportError as exc:
            raise _classify(exc, head=False) from None

    async def read(self, resp: Response, limit: int | None = None) -> bytes:
        """The whole body as sent (encoded if the engine encoded it), at most `limit` bytes
        (`upstream.max_response_bytes` by default): beyond it, `upstream_response_too_large`."""
        limit = self.cfg.max_response_bytes if limit is None else limit
        declared = resp.header("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise _too_large(limit)
        parts: list[bytes] = []
        size = 0
        while True:  # chunks() but for its async generator, a microsecond per answer
            chunk = _ready(resp)
            if chunk is None:
                chunk = await self._next(resp)
            if not chunk:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)

    async def read_content(self, resp: Response, limit: int | None = None) -> bytes:
        """The body the gateway itself must understand (error bodies, the prefill leg's answer):
        `read`, then gzip or deflate undone, the decoded size bounded by the same limit."""
        limit = self.cfg.max_response_bytes if limit is None else limit
        raw = await self.read(resp, limit)
        encoding = (resp.header("content-encoding") or "identity").strip().lower()
        if encoding == "identity":
            return raw
        if encoding in ("gzip", "x-gzip", "deflate"):
            decoder = zlib.decompressobj(zlib.MAX_WBITS | (16 if encoding != "deflate" else 0))
            try:
                out = decoder.decompress(raw, limit + 1)
            except zlib.error as exc:
                raise UpstreamError(
                    f"engine body is not valid {encoding}: {exc}", code="upstream_bad_response"
                ) from None
            if len(out) > limit:
                raise _too_large(limit)
            return out
        raise UpstreamError(
            f"engine body has an encoding the gateway cannot read: {encoding[:40]!r}",
            code="upstream_bad_response",
            replica_fault=False,
        )
