"""The transport on aiohttp's client (`upstream.transport: aiohttp`): the well-kept library
fallback to kvgate's own HTTP/1.1 client, held to the same hostile-upstream suite.

aiohttp already skips 1xx answers, bounds header lines and counts, and never resends a POST.
Two things are added: a connection that received bytes while idle (an answer nobody asked
for, parsed and queued by aiohttp) or has bytes waiting in the kernel is closed rather than
reused (`_CleanConnector`), and nothing is decoded or added behind the gateway's back
(no automatic Accept-Encoding, User-Agent or decompression, no cookies, no proxies from the
environment). It makes no silent resend: it cannot tell a stale connection from an engine
that closed without answering, so that costs a retry instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from gateway.transports.base import (
    ConnectError,
    DisconnectedError,
    ProtocolError,
    Slot,
    Target,
    TransportError,
    client_tls_context,
    describe,
    find_header,
    header_block,
    media_type,
    pending_bytes,
    valid_response_header,
)

if TYPE_CHECKING:
    from gateway.config import UpstreamConfig


class _CleanConnector(aiohttp.TCPConnector):
    async def _get(self, key: Any, traces: Any) -> Any:
        # aiohttp's own check is only "still connected"; ours is also "nothing arrived since".
        while (conn := await super()._get(key, traces)) is not None:
            proto = conn.protocol
            transport = proto.transport if proto is not None else None
            sock = transport.get_extra_info("socket") if transport is not None else None
            if sock is not None and not proto.should_close and pending_bytes(sock.fileno()) == 0:
                return conn
            conn.close()
        return None


def _body_error(exc: BaseException) -> TransportError:
    if isinstance(exc, aiohttp.ClientPayloadError) and "not completed" not in str(exc):
        return ProtocolError(f"malformed response body from the engine: {exc}")
    return DisconnectedError(f"engine closed the connection mid-answer ({describe(exc)})")


class AiohttpResponse:
    __slots__ = ("_resp", "_slot", "headers", "sent", "status")

    def __init__(self, resp: aiohttp.ClientResponse, slot: Slot) -> None:
        self.status = resp.status
        self.sent = 1
        self.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers]
        self._resp = resp
        self._slot = slot

    def header(self, name: str) -> str | None:
        return find_header(self.headers, name)

    @property
    def content_type(self) -> str:
        return media_type(self.headers)

    async def readany(self) -> bytes:
        try:
            return await self._resp.content.readany()
        except (aiohttp.ClientError, OSError) as exc:
            raise _body_error(exc) from None

    def release(self) -> None:
        self._resp.release()  # aiohttp keeps the connection only if the body was read to its end
        self._slot.release()

    def close(self) -> None:
        self._resp.close()
        self._slot.release()


class AiohttpTransport:
    def __init__(self, cfg: UpstreamConfig) -> None:
        self.cfg = cfg
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # inside the running loop, as aiohttp wants
            cfg = self.cfg
            connector = _CleanConnector(
                limit=0,
                limit_per_host=cfg.max_connections,
                ssl=client_tls_context(cfg.tls.verify, cfg.tls.ca_file),
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s),
                max_line_size=cfg.max_header_bytes,
                max_field_size=cfg.max_header_bytes,
                max_headers=cfg.max_headers,
            )
        return self._session

    async def request(
        self,
        method: str,
        target: Target,
        body: bytes,
        headers: Mapping[str, str],
        *,
        slot: Slot,
        resend: bool,
    ) -> AiohttpResponse:
        header_block(headers)  # the same refusals as the http1 transport
        where = target.host_header
        try:
            resp = await self._client().request(
                method, target.url, data=body, headers=dict(headers), allow_redirects=False
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise ConnectError(f"cannot connect to {where}: {describe(exc)}") from None
        except aiohttp.ClientResponseError as exc:
            raise ProtocolError(f"malformed response from the engine: {exc.message}", sent=1) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise DisconnectedError(
                f"engine closed the connection before answering ({describe(exc)})", sent=1
            ) from None
        if not 200 <= resp.status <= 599:  # 101: nothing here asked to switch protocols
            resp.close()
            raise ProtocolError(f"engine answered with status {resp.status}", sent=1)
        if not all(valid_response_header(k, v) for k, v in resp.raw_headers):
            resp.close()
            raise ProtocolError("malformed response from the engine: invalid header bytes", sent=1)
        return AiohttpResponse(resp, slot)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
