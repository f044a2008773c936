"""The transport on aiohttp's client (`upstream.transport: aiohttp`): the well-kept library
fallback to kvgate's own HTTP/1.1 client, held to the same hostile-upstream suite.

aiohttp already skips 1xx answers, bounds header lines and counts, and never resends a POST.
Two things are added: a connection that received bytes while idle (an answer nobody asked
for, parsed and queued by aiohttp) or has bytes waiting in the kernel is closed rather than
reused (`_CleanConnector`), and nothing is decoded or added behind the gateway's back
(no automatic Accept-Encoding, User-Agent or decompression, no cookies, no proxies from the
environment). A request that fails on a reused connection before any answer, or whose answer was
not its own, is resent once, when the caller allows it, and, as by the http1 transport, on a
fresh connection (a session of its own that never reuses one: aiohttp's pool could hand out
another connection just as doubtful): aiohttp itself never resends a POST. Idle connections close
after `upstream.keepalive_s`.
As with the http1 transport, an answer on a reused connection must carry the `X-Request-Id`
sent, and connections to engines that do not echo it are closed after one answer
(`AnswerProof`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from gateway.path.transports.base import (
    AnswerProof,
    ConnectError,
    DisconnectedError,
    HeaderLookup,
    ProtocolError,
    Slot,
    StrayAnswerError,
    Target,
    TransportError,
    client_tls_context,
    describe,
    header_block,
    pending_bytes,
    request_id,
    valid_response_header,
)

if TYPE_CHECKING:
    from gateway.config import UpstreamConfig


class _CleanConnector(aiohttp.TCPConnector):
    def __init__(self, proof: AnswerProof, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proof = proof

    async def _get(self, key: Any, traces: Any) -> Any:
        # aiohttp's own check is only "still connected"; ours is also "nothing arrived since",
        # and "the engine's answers on it can be proved" (aiohttp pools a connection as soon as
        # its answer was read, before anyone could say otherwise).
        # Traces (which tell a request it got a reused connection) only for the one handed out.
        reusable = self._proof.reusable(("https" if key.is_ssl else "http", key.host, key.port))
        while (conn := await super()._get(key, [])) is not None:
            proto = conn.protocol
            transport = proto.transport if proto is not None else None
            sock = transport.get_extra_info("socket") if transport is not None else None
            open_ = proto is not None and not proto.should_close
            if reusable and sock is not None and open_ and pending_bytes(sock.fileno()) == 0:
                for trace in traces:
                    await trace.send_connection_reuseconn()
                return conn
            conn.close()
        return None


class _Attempt:
    """Whether aiohttp took a pooled connection for this try (told through its trace hooks)."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _mark_reused(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    ctx.trace_request_ctx.reused = True


def _body_error(exc: BaseException) -> TransportError:
    if isinstance(exc, aiohttp.ClientPayloadError) and "not completed" not in str(exc):
        return ProtocolError(f"malformed response body from the engine: {exc}")
    return DisconnectedError(f"engine closed the connection mid-answer ({describe(exc)})")


class AiohttpResponse(HeaderLookup):
    __slots__ = ("_resp", "_slot", "headers", "sent", "status")

    def __init__(self, resp: aiohttp.ClientResponse, slot: Slot, sent: int) -> None:
        self.status = resp.status
        self.sent = sent
        self.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers]
        self._resp = resp
        self._slot = slot

    async def readany(self) -> bytes:
        try:
            return await self._resp.content.readany()
        except (aiohttp.ClientError, OSError) as exc:
            raise _body_error(exc) from None

    def read_nowait(self) -> bytes | None:
        content = self._resp.content
        try:
            data = content.read_nowait()
        except (aiohttp.ClientError, OSError) as exc:
            raise _body_error(exc) from None
        return data if data or content.at_eof() else None

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
        self._fresh: aiohttp.ClientSession | None = None  # for resends: never a reused connection
        self.proof = AnswerProof(cfg.reuse_unverified_connections)

    def _client(self, fresh: bool = False) -> aiohttp.ClientSession:
        if fresh:
            if self._fresh is None:
                self._fresh = self._new_session(
                    aiohttp.TCPConnector(
                        force_close=True,
                        limit=0,
                        limit_per_host=self.cfg.max_connections,
                        ssl=client_tls_context(self.cfg.tls.verify, self.cfg.tls.ca_file),
                    )
                )
            return self._fresh
        if self._session is None:  # inside the running loop, as aiohttp wants
            cfg = self.cfg
            self._session = self._new_session(
                _CleanConnector(
                    self.proof,
                    limit=0,
                    limit_per_host=cfg.max_connections,
                    keepalive_timeout=cfg.keepalive_s,
                    ssl=client_tls_context(cfg.tls.verify, cfg.tls.ca_file),
                )
            )
        return self._session

    def _new_session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        cfg = self.cfg
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_mark_reused)
        return aiohttp.ClientSession(
            connector=connector,
            trace_configs=[reuse],
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s),
            max_line_size=cfg.max_header_bytes,
            max_field_size=cfg.max_header_bytes,
            max_headers=cfg.max_headers,
        )

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
        if not (self.proof.reusable(target.origin) and request_id(headers) is not None):
            headers = {**headers, "Connection": "close"}  # so that the engine closes first
        sent = 1
        try:
            resp = await self._send(method, target, body, headers, sent)
        except DisconnectedError as exc:
            if not (resend and exc.stale):
                raise
            sent = 2  # once more, on a fresh connection
            resp = await self._send(method, target, body, headers, sent, fresh=True)
        except StrayAnswerError:
            if not resend:
                raise
            sent = 2
            resp = await self._send(method, target, body, headers, sent, fresh=True)
        return AiohttpResponse(resp, slot, sent)

    async def _send(
        self,
        method: str,
        target: Target,
        body: bytes,
        headers: Mapping[str, str],
        sent: int,
        fresh: bool = False,
    ) -> aiohttp.ClientResponse:
        attempt = _Attempt()
        try:
            resp = await self._client(fresh).request(
                method,
                target.url,
                data=body,
                headers=dict(headers),
                allow_redirects=False,
                trace_request_ctx=attempt,
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise ConnectError(
                f"cannot connect to {target.host_header}: {describe(exc)}", sent=sent - 1
            ) from None
        except aiohttp.ClientResponseError as exc:
            raise ProtocolError(f"malformed response from the engine: {exc.message}", sent=sent) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise DisconnectedError(
                f"engine closed the connection before answering ({describe(exc)})",
                sent=sent,
                stale=attempt.reused,
            ) from None
        if not 200 <= resp.status <= 599:  # 101: nothing here asked to switch protocols
            resp.close()
            raise ProtocolError(f"engine answered with status {resp.status}", sent=sent)
        if not all(valid_response_header(k, v) for k, v in resp.raw_headers):
            resp.close()
            raise ProtocolError("malformed response from the engine: invalid header bytes", sent=sent)
        try:
            self.proof.check(
                target.origin, attempt.reused, request_id(headers), resp.headers.get("X-Request-Id")
            )
        except StrayAnswerError as exc:
            resp.close()
            exc.sent = sent
            raise
        return resp

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None
