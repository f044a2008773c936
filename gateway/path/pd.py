"""Prefill/decode hand-off: vLLM's sequential NIXL relay and SGLang's concurrent bootstrap.

The pool's policy picks both legs (`select_pair`); this module decides whether to disaggregate
(only when the first decode replica lacks enough of the prompt), runs the prefill leg on the
first prefill replica of the pair that admits it, and returns the body the decode leg must carry:

- vLLM (`vllm-nixl-sequential`): the prefill leg is the client's body as a one-token,
  non-streaming request with `kv_transfer_params.do_remote_decode`; its answer's
  `kv_transfer_params` go verbatim into the decode leg. Prefill 5xx or unreachable: decode
  does the whole request itself. Prefill 4xx: the client gets it.
- SGLang (`sglang-bootstrap-concurrent`): one body with `bootstrap_host/port/room` goes to
  both at once; the decode answer is relayed. A prefill leg that fails at transport level
  before the decode answered cancels the decode (see `guard`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard
from urllib.parse import urlsplit

import orjson

from gateway.errors import GatewayError, normalize_error_body
from gateway.fleet.engines.base import SGLANG_CONCURRENT
from gateway.fleet.replica import Replica
from gateway.path.claim import Claim
from gateway.path.transports.base import Response
from gateway.path.upstream import Upstream, UpstreamError
from gateway.routing.policy import Candidate, RequestFeatures

if TYPE_CHECKING:
    from gateway.fleet.pool import Pool
    from gateway.routing.pool_router import PoolRouter

log = logging.getLogger(__name__)

_NO_REMOTE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# What a client is told when a hand-off's prefill replica was lost and the answer was not continued.
PREFILL_LOST = "the prefill replica holding the prompt's KV was lost before the answer began"


class PrefillWatch:
    """A hand-off's decode leg, until its first bytes: vLLM's decode replica waits on the prefill
    replica's KV without a deadline (a stopped prefill held a request until its client gave up, on
    the H200), so should health checks eject `prefill` (None: no hand-off, nothing to watch)
    before then, the leg's answer is closed and `prefill_lost` recorded in `cuts`."""

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


def vllm_prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    leg = dict(body)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)  # vLLM rejects stream_options without stream
    leg.pop("min_tokens", None)
    leg["kv_transfer_params"] = dict(_NO_REMOTE)
    return leg


def vllm_decode_body(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    return {**body, "kv_transfer_params": kv_transfer_params}


def sglang_body(body: Mapping[str, Any], prefill: Replica, room: int | None = None) -> dict[str, Any]:
    if prefill.bootstrap_port is None:
        raise ValueError(f"prefill replica {prefill.name} has no bootstrap port")
    room = random.getrandbits(63) if room is None else room
    prompts = body.get("prompt")
    # A batched completion needs one room per item.
    rooms: int | list[int] = [room + i for i in range(len(prompts))] if _is_batch(prompts) else room
    host = urlsplit(prefill.url).hostname or "127.0.0.1"
    return {**body, "bootstrap_host": host, "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": rooms}


def _is_batch(prompt: Any) -> TypeGuard[list[Any]]:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


@dataclass(slots=True)
class DecodePlan:
    body: bytes
    alone: bytes  # the request as a decode replica serves it without a hand-off (`body` if none)
    prefill: Replica | None = None
    guard: asyncio.Task[None] | None = None  # SGLang's concurrent prefill leg
    claim: Claim | None = None  # the guard's claim on the prefill replica
    pool: Pool | None = None  # where `transfer` tokens are counted
    transfer: int = 0  # prompt tokens counted in `pool.transfer_tokens` until the decode leg answers

    @property
    def pending(self) -> bool:
        """Whether `finish` has anything to do: a prefill leg ran for this plan."""
        return self.guard is not None or self.claim is not None or self.transfer > 0

    def transferred(self) -> None:
        """The decode leg began to answer (or was given up): its KV is no longer in transfer."""
        if self.transfer and self.pool is not None:
            self.pool.transfer_tokens -= self.transfer
        self.transfer = 0

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


class PDHandoff:
    def __init__(self, upstream: Upstream, resend: bool) -> None:
        self.upstream = upstream
        self.resend = resend  # may a prefill leg cost a stale connection's silent resend

    @staticmethod
    def skip(pool: Pool, features: RequestFeatures, decode: Candidate) -> str | None:
        """Why the decode replica serves the request whole (None: disaggregate): `skipped`, it
        would not have to prefill enough new tokens; `link_full`, the hand-offs whose KV is in
        transfer hold `pd.max_transfer_tokens` (one always may: a long prompt is not barred)."""
        uncached = features.prompt_tokens - decode.matched_tokens
        if pool.pd_protocol is None or uncached < pool.cfg.pd.min_uncached_tokens:
            return "skipped"
        cap = pool.cfg.pd.max_transfer_tokens
        if cap and pool.transfer_tokens and pool.transfer_tokens + features.prompt_tokens > cap:
            return "link_full"
        return None

    @staticmethod
    def _in_transfer(plan: DecodePlan, pool: Pool, tokens: int) -> DecodePlan:
        plan.pool, plan.transfer = pool, tokens
        pool.transfer_tokens += tokens
        return plan

    async def prepare(
        self,
        router: PoolRouter,
        features: RequestFeatures,
        prefills: list[Candidate],
        body: dict[str, Any],
        raw: bytes,
        path: str,
        headers: Mapping[str, str],
    ) -> DecodePlan:
        tokens = features.prompt_tokens
        claim: Claim | None = None
        for candidate in prefills:
            replica = router.replica(candidate)
            # `available` again: a continuation's candidates were ranked before its prefill was lost.
            if replica is None or not replica.available:
                continue
            if (claim := Claim.take(replica, tokens)) is not None:
                break
        if claim is None:
            return DecodePlan(raw, raw)  # no prefill capacity: the decode replica does it all
        prefill = claim.replica
        router.learn(features, prefill, prefill_leg=True)
        if router.pool.pd_protocol == SGLANG_CONCURRENT:
            try:
                leg = orjson.dumps(sglang_body(body, prefill))
            except BaseException:
                claim.close()
                raise
            guard = asyncio.create_task(self._sglang_prefill(claim, path, leg, headers))
            return self._in_transfer(DecodePlan(leg, raw, prefill, guard, claim), router.pool, tokens)
        with claim:
            plan = await self._vllm_prefill(claim, body, raw, path, headers, features)
        return plan if plan.body is plan.alone else self._in_transfer(plan, router.pool, tokens)

    async def _vllm_prefill(
        self,
        claim: Claim,
        body: dict[str, Any],
        raw: bytes,
        path: str,
        headers: Mapping[str, str],
        features: RequestFeatures,
    ) -> DecodePlan:
        prefill = claim.replica
        leg = orjson.dumps(vllm_prefill_body(body))
        try:
            resp = await self.upstream.open("POST", prefill.url + path, leg, headers, resend=self.resend)
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
        try:
            kv = orjson.loads(answer).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            kv = None
        if not isinstance(kv, dict):  # the decode replica then does the full prefill itself
            return DecodePlan(raw, raw, prefill)
        expected = prefill.kv_side_channel_host
        if expected is not None and kv.get("remote_host") != expected:
            # An engine's answer must not send another engine elsewhere for its KV.
            log.warning(
                "request %s: prefill %s named %r for its KV, not its side channel %r; decode-only",
                features.request_id,
                prefill.name,
                str(kv.get("remote_host"))[:80],
                expected,
            )
            return DecodePlan(raw, raw, prefill)
        return DecodePlan(orjson.dumps(vllm_decode_body(body, kv)), raw, prefill)

    async def _sglang_prefill(self, claim: Claim, path: str, leg: bytes, headers: Mapping[str, str]) -> None:
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
