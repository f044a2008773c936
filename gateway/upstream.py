"""How bytes move to and from engines: one pooled keep-alive aiohttp session and timeouts.

Where a request goes is decided elsewhere (proxy); this module only opens a request,
yields body chunks under an idle timeout, and classifies transport failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import aiohttp

from gateway.config import UpstreamConfig


class UpstreamError(Exception):
    """The engine could not be reached or stopped answering."""

    def __init__(self, message: str, *, connect: bool = False, timeout: bool = False) -> None:
        super().__init__(message)
        self.connect = connect  # failed before the request reached the engine: safe to retry
        self.timeout = timeout


class Upstream:
    def __init__(self, cfg: UpstreamConfig) -> None:
        self.cfg = cfg
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # aiohttp sets TCP_NODELAY on every connection (BaseProtocol.connection_made), which
            # matters: a streamed first token otherwise waits on Nagle + delayed ACK (~40 ms).
            connector = aiohttp.TCPConnector(
                limit=self.cfg.max_connections,
                limit_per_host=0,
                keepalive_timeout=75,
                ttl_dns_cache=300,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """Send the request and wait for the response headers (first-byte timeout)."""
        try:
            async with asyncio.timeout(self.cfg.first_byte_timeout_s):
                return await self.session.request(method, url, data=body, headers=headers)
        except TimeoutError:
            raise UpstreamError(
                f"no response from the engine within {self.cfg.first_byte_timeout_s:g} s", timeout=True
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(f"cannot connect to the engine: {exc.os_error}", connect=True) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # Nothing was answered: the engine died or closed a stale keep-alive connection.
            raise UpstreamError(f"engine closed the connection: {exc}", connect=True) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream request failed: {exc}") from None

    async def chunks(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The response body as it arrives, failing if the engine goes quiet for too long."""
        idle = self.cfg.idle_timeout_s
        loop = asyncio.get_running_loop()
        content = resp.content
        try:
            async with asyncio.timeout(loop.time() + idle) as cm:
                while True:
                    chunk = await content.readany()
                    if not chunk:
                        return
                    cm.reschedule(loop.time() + idle)
                    yield chunk
        except TimeoutError:
            raise UpstreamError(f"engine sent nothing for {idle:g} s", timeout=True) from None
        except aiohttp.ClientPayloadError as exc:
            raise UpstreamError(f"engine response cut short: {exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"engine connection failed mid-response: {exc}") from None

    async def read(self, resp: aiohttp.ClientResponse) -> bytes:
        parts = [chunk async for chunk in self.chunks(resp)]
        return b"".join(parts)
