"""The prefill/decode hand-off: whether to disaggregate a request, its prefill leg, and the waits of
its decode leg. The bodies are the pool's connector's (gateway/fleet/engines/: vLLM's NIXL relay,
one leg after the other; SGLang's bootstrap, both legs at once); this module does the sending.

Disaggregate only when the first decode candidate lacks enough of the prompt (`pd.min_uncached_tokens`)
and the KV in transfer leaves room (`pd.max_transfer_tokens`). The prefill leg goes to the first
prefill candidate that admits it. A sequential prefill that fails (5xx, unreachable) or hands
nothing over leaves the decode replica to serve the request whole; a 4xx is the client's answer.
A concurrent prefill leg that fails at transport level before the decode leg answered fails that
leg too (`guard`). A decode leg that waits on its prefill replica's KV without a deadline (the
connector's `waits_for_kv`) stops waiting once health checks eject that replica (`PrefillLost`,
or `prefill_lost` in `PrefillWatch` once its answer began).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import GatewayError, normalize_error_body
from gateway.fleet.engines import Connector
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.path.claim import Claim
from gateway.path.transports.base import Response
from gateway.path.upstream import Upstream, UpstreamError
from gateway.routing.decision import Decision
from gateway.routing.policy import Candidate, RequestFeatures

log = logging.getLogger(__name__)

# What a client is told when a hand-off's prefill replica was lost and the answer was not continued.
PREFILL_LOST = "the prefill replica holding the prompt's KV was lost before the answer began"


class PrefillLost(Exception):
    """A hand-off's prefill replica was ejected before its decode leg answered."""


@dataclass(slots=True)
class DecodePlan:
    """How the decode (or whole) leg goes out: `body` carries a prefill leg's KV, unless it is
    `alone`, the request as a decode replica serves it without a hand-off."""

    body: bytes
    alone: bytes
    prefill: Replica | None = None
    connector: Connector | None = None
    guard: asyncio.Task[None] | None = None  # a concurrent prefill leg
    claim: Claim | None = None  # the guard's claim on the prefill replica
    pool: Pool | None = None  # where `transfer` tokens are counted
    transfer: int = 0  # prompt tokens counted in `pool.transfer_tokens` until the decode leg answers

    @property
    def handoff(self) -> bool:
        """Whether the decode leg carries a prefill leg's KV."""
        return self.body is not self.alone

    @property
    def kv_from(self) -> Replica | None:
        """The prefill replica the decode leg waits on for its KV, where the connector waits
        without a deadline (None: nothing to watch)."""
        waits = self.handoff and self.connector is not None and self.connector.waits_for_kv
        return self.prefill if waits else None

    @property
    def pending(self) -> bool:
        """Whether `finish` has anything to do: a prefill leg ran for this plan."""
        return self.guard is not None or self.claim is not None or self.transfer > 0

    def drop(self) -> None:
        """The KV will not come (its prefill replica lost, or the decode replica could not fetch
        it): from now on the decode replica serves the request whole."""
        self.body = self.alone
        self.transferred()

    def transferred(self) -> None:
        """The decode leg began to answer (or was given up): its KV is no longer in transfer."""
        if self.transfer and self.pool is not None:
            self.pool.transfer_tokens -= self.transfer
        self.transfer = 0

    async def open(self, opening: Coroutine[Any, Any, Response]) -> Response:
        """The decode leg's answer head, waiting on its prefill leg as the connector needs."""
        if self.guard is not None:
            return await _beside_prefill(opening, self.guard)
        kv_from = self.kv_from
        if kv_from is not None:
            return await _unless_ejected(opening, kv_from)
        return await opening

    async def finish(self) -> None:
        """After the decode leg: a prefill leg still running is no longer needed, and its claim
        is settled even if its task was cancelled before it ever ran."""
        self.transferred()
        try:
            if self.guard is not None:
                self.guard.cancel()
                await asyncio.gather(self.guard, return_exceptions=True)
        finally:
            if self.claim is not None:
                self.claim.close()


class PrefillWatch:
    """A hand-off's decode leg, until its first bytes: should health checks eject the prefill
    replica it waits on (None: nothing to watch) first, the leg's answer is closed and
    `prefill_lost` recorded in `cuts`."""

    __slots__ = ("cuts", "heard", "prefill", "resp")

    def __init__(self, prefill: Replica | None, resp: Response, cuts: list[str]) -> None:
        self.prefill, self.resp, self.cuts = prefill, resp, cuts
        self.heard = False  # the leg's first bytes came: its KV arrived
        if prefill is not None:
            prefill.on_eject.add(self._ejected)
            if not prefill.healthy:  # ejected before this leg's head came
                self._ejected()

    def _ejected(self) -> None:
        if not self.heard:
            self.cuts.append("prefill_lost")
            self.resp.close()

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.on_eject.discard(self._ejected)


class HandOff:
    def __init__(self, upstream: Upstream, resend: bool) -> None:
        self.upstream = upstream
        self.resend = resend  # may a prefill leg cost a stale connection's silent resend

    @staticmethod
    def skip(pool: Pool, features: RequestFeatures, decode: Candidate) -> str | None:
        """Why the decode replica serves the request whole (None: disaggregate): `skipped`, it
        would not have to prefill enough new tokens; `link_full`, the hand-offs whose KV is in
        transfer hold `pd.max_transfer_tokens` (one always may: a long prompt is not barred)."""
        uncached = features.prompt_tokens - decode.matched_tokens
        if pool.connector is None or uncached < pool.cfg.pd.min_uncached_tokens:
            return "skipped"
        cap = pool.cfg.pd.max_transfer_tokens
        if cap and pool.transfer_tokens and pool.transfer_tokens + features.prompt_tokens > cap:
            return "link_full"
        return None

    async def prepare(
        self,
        decision: Decision,
        features: RequestFeatures,
        body: dict[str, Any],
        raw: bytes,
        path: str,
        headers: Mapping[str, str],
    ) -> DecodePlan:
        """The prefill leg on the first of the decision's prefill candidates that admits it (for
        `features`, the request's or a continuation's), and the decode leg's plan."""
        claim: Claim | None = None
        for candidate in decision.prefills:
            replica = decision.replica_of(candidate)
            # `available` again: a continuation's candidates were ranked before its prefill was lost.
            if replica is None or not replica.available:
                continue
            if (claim := Claim.take(replica, features.prompt_tokens)) is not None:
                break
        if claim is None:
            return DecodePlan(raw, raw)  # no prefill capacity: the decode replica does it all
        prefill = claim.replica
        pool = decision.router.pool
        connector = pool.connector
        assert connector is not None, "a hand-off in a pool without prefill replicas"
        decision.sent_prefill(prefill, features)
        try:
            leg = connector.prefill_body(body, prefill)
        except BaseException:
            claim.close()
            raise
        if connector.concurrent:
            decode = connector.decode_body(body, prefill, leg, None).body
            assert decode is not None, "a concurrent connector refused its own leg"
            sent = orjson.dumps(decode)
            guard = asyncio.create_task(self._concurrent_prefill(claim, path, sent, headers))
            plan = DecodePlan(sent, raw, prefill, connector, guard, claim)
        else:
            with claim:
                plan = await self._sequential_prefill(
                    claim, connector, body, leg, raw, path, headers, features
                )
        if plan.handoff:
            plan.pool, plan.transfer = pool, features.prompt_tokens
            pool.transfer_tokens += plan.transfer
        return plan

    async def _sequential_prefill(
        self,
        claim: Claim,
        connector: Connector,
        body: dict[str, Any],
        leg: dict[str, Any],
        raw: bytes,
        path: str,
        headers: Mapping[str, str],
        features: RequestFeatures,
    ) -> DecodePlan:
        prefill = claim.replica
        try:
            resp = await self.upstream.open(
                "POST", prefill.url + path, orjson.dumps(leg), headers, resend=self.resend
            )
            try:
                answer = await self.upstream.read_content(resp)
            finally:
                resp.release()
        except UpstreamError as exc:
            if exc.replica_fault:
                claim.failed()
            log.warning(
                "request %s: prefill on %s failed (%s); decode-only", features.request_id, prefill.name, exc
            )
            return DecodePlan(raw, raw)
        claim.answered()
        if resp.status >= 500:
            log.warning(
                "request %s: prefill on %s answered %d; decode-only",
                features.request_id,
                prefill.name,
                resp.status,
            )
            return DecodePlan(raw, raw)
        if resp.status >= 400:
            # The client's request is at fault: it gets the prefill's answer, not a decode attempt.
            raise GatewayError(resp.status, "prefill refused", body=normalize_error_body(answer, resp.status))
        decode = connector.decode_body(body, prefill, leg, answer)
        if decode.body is None:  # the decode replica then does the full prefill itself
            if decode.refused is not None:  # one engine must not send another elsewhere
                log.warning(
                    "request %s: prefill %s %s; decode-only",
                    features.request_id,
                    prefill.name,
                    decode.refused,
                )
            return DecodePlan(raw, raw, prefill, connector)
        return DecodePlan(orjson.dumps(decode.body), raw, prefill, connector)

    async def _concurrent_prefill(
        self, claim: Claim, path: str, leg: bytes, headers: Mapping[str, str]
    ) -> None:
        with claim:
            url = claim.replica.url + path
            try:
                resp = await self.upstream.open("POST", url, leg, headers, resend=self.resend)
                try:
                    await self.upstream.read(resp)
                finally:
                    resp.release()
            except UpstreamError as exc:
                if exc.replica_fault:
                    claim.failed()
                raise
            claim.answered()


async def _beside_prefill(opening: Coroutine[Any, Any, Response], guard: asyncio.Task[None]) -> Response:
    """Open the decode leg beside a concurrent prefill leg (`guard`): fail fast if that leg breaks
    first."""
    decode = asyncio.ensure_future(opening)
    try:
        await asyncio.wait({decode, guard}, return_when=asyncio.FIRST_COMPLETED)
        if not decode.done() and guard.exception() is not None:
            # The decode replica is not at fault: its bootstrap partner went away.
            raise UpstreamError(
                f"prefill leg failed: {guard.exception()}",
                code="upstream_prefill_failed",
                replica_fault=False,
                public="its prefill leg failed",
            )
        return await decode
    except BaseException:
        await _abandon(decode)
        raise


async def _unless_ejected(opening: Coroutine[Any, Any, Response], prefill: Replica) -> Response:
    """Open a decode leg that takes its KV from `prefill`, waiting on that fetch without a
    deadline of its own: should `prefill` be ejected by its health checks first, stop waiting."""
    if not prefill.healthy:  # ejected between its answer and now
        opening.close()
        raise PrefillLost
    decode = asyncio.ensure_future(opening)
    lost = asyncio.get_running_loop().create_future()

    def ejected() -> None:
        if not lost.done():
            lost.set_result(None)

    prefill.on_eject.add(ejected)
    try:
        await asyncio.wait({decode, lost}, return_when=asyncio.FIRST_COMPLETED)
        if not decode.done():
            raise PrefillLost
        return await decode
    except BaseException:
        await _abandon(decode)
        raise
    finally:
        prefill.on_eject.discard(ejected)
        lost.cancel()


async def _abandon(opening: asyncio.Future[Response]) -> None:
    """Stop an opening nobody will read; an answer that arrived anyway is closed, not leaked."""
    opening.cancel()
    await asyncio.gather(opening, return_exceptions=True)
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()
