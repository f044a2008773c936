"""How bytes move to and from engines on the hot path: pooled keep-alive connections
(gateway/http1.py) and the timeouts around them.

Where a request goes is decided elsewhere (proxy); this module only opens a request,
yields body chunks under an idle timeout, and classifies transport failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from gateway.config import UpstreamConfig
from gateway.http1 import ConnectError, ConnectionPool, ProtocolError, UpstreamResponse


class UpstreamError(Exception):
    """The engine could not be reached or stopped answering."""

    def __init__(self, message: str, *, connect: bool = False, timeout: bool = False) -> None:
        super().__init__(message)
        self.connect = connect  # failed before the engine answered anything: safe to retry
        self.timeout = timeout


class Upstream:
    def __init__(self, cfg: UpstreamConfig) -> None:
        self.cfg = cfg
        self.pool = ConnectionPool(cfg.connect_timeout_s)

    async def close(self) -> None:
        self.pool.close()

    async def open(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        """Send the request and wait for the response headers (first-byte timeout)."""
        try:
            async with asyncio.timeout(self.cfg.first_byte_timeout_s):
                return await self.pool.request(method, url, body, headers)
        except TimeoutError:
            raise UpstreamError(
                f"no response from the engine within {self.cfg.first_byte_timeout_s:g} s", timeout=True
            ) from None
        except ConnectError as exc:
            raise UpstreamError(str(exc), connect=True) from None
        except ProtocolError as exc:
            raise UpstreamError(str(exc)) from None

    async def chunks(self, resp: UpstreamResponse) -> AsyncIterator[bytes]:
        """The response body as it arrives, failing if the engine goes quiet for too long."""
        idle = self.cfg.idle_timeout_s
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(loop.time() + idle) as cm:
                while True:
                    chunk = await resp.readany()
                    if not chunk:
                        return
                    cm.reschedule(loop.time() + idle)
                    yield chunk
        except TimeoutError:
            raise UpstreamError(f"engine sent nothing for {idle:g} s", timeout=True) from None
        except (ProtocolError, ConnectError, ConnectionError) as exc:
            raise UpstreamError(f"engine response cut short: {exc}") from None

    async def read(self, resp: UpstreamResponse) -> bytes:
        parts = [chunk async for chunk in self.chunks(resp)]
        return b"".join(parts)
