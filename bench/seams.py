"""What mid-stream failover did in a faults run: streams cut, answers continued, whether each
continued answer is the uninterrupted one, and the time its seam added.

- cut: the client got its stream's head (200) and then an error event, or the stream broke;
- resumed: the gateway's access log says the answer was continued (`resumed`);
- token-identical: a continued answer's text equals the same request's answer asked again after
  the run with nothing failing (greedy decoding: the clients send temperature 0);
- the control: as many answers that were never continued, asked again the same way. Where the
  engine's greedy answers depend on the batch they ran in (dummy weights' near-ties, say), the
  control falls too, and the token-identical count says nothing about the seam;
- seam: the longest pause between two chunks of a continued stream less the stream's median
  pause, i.e. what the failure, its detection, the new attempt and its prefill added.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
from collections.abc import Sequence
from typing import Any, Protocol

import aiohttp
import orjson

from bench.stats import distribution_ms


class Streamed(Protocol):
    marker: str
    status: int
    outcome: str
    body: dict[str, Any] | None
    text: str
    chunk_times: list[float]


def seam_s(times: list[float]) -> float | None:
    """The longest gap between chunks, less the median gap (None with fewer than three chunks)."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if len(gaps) < 2:
        return None
    return max(gaps) - statistics.median(gaps)


async def _answer(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str | None:
    async with session.post(url + "/v1/chat/completions", data=orjson.dumps({**body, "stream": False})) as r:
        if r.status != 200:
            return None
        doc = orjson.loads(await r.read())
        return doc["choices"][0]["message"]["content"]


async def replay(url: str, answers: Sequence[Streamed], concurrency: int = 8) -> list[bool]:
    """Each continued answer's text against the same request asked again, uninterrupted."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one(o: Streamed) -> bool:
            assert o.body is not None
            async with gate:
                return await _answer(session, url, o.body) == o.text

        return list(await asyncio.gather(*(one(o) for o in answers)))


def resumed(outcomes: Sequence[Streamed], access: dict[str, dict[str, Any]]) -> list[Streamed]:
    """Completed streams the gateway continued after a failure."""
    return [o for o in outcomes if o.outcome == "completed" and access.get(o.marker, {}).get("resumed")]


def control(outcomes: Sequence[Streamed], access: dict[str, dict[str, Any]], n: int) -> list[Streamed]:
    """`n` completed streams (at least 20, where there are) that were never continued, spread
    evenly over the run: the control for `replay`."""
    plain = [
        o
        for o in outcomes
        if o.outcome == "completed"
        and o.body is not None
        and o.marker in access
        and not access[o.marker].get("resumed")
    ]
    n = min(len(plain), max(n, 20))
    return [plain[i * len(plain) // n] for i in range(n)] if n else []


def summary(
    outcomes: Sequence[Streamed],
    access: dict[str, dict[str, Any]],
    identical: list[bool],
    control_identical: Sequence[bool] = (),
) -> dict[str, Any]:
    cont = resumed(outcomes, access)
    seams = distribution_ms(s for o in cont if (s := seam_s(o.chunk_times)) is not None)
    reasons: dict[str, int] = {}
    by_reason: dict[str, list[float]] = {}
    for o in cont:
        for r in access[o.marker]["resumed"]:
            reason = r.partition("@")[0]
            reasons[reason] = reasons.get(reason, 0) + 1
        first = access[o.marker]["resumed"][0].partition("@")[0]
        if (seam := seam_s(o.chunk_times)) is not None:
            by_reason.setdefault(first, []).append(seam)
    return {
        "cut": sum(o.status == 200 and o.outcome in ("error", "lost") for o in outcomes),
        "resumed": len(cont),
        "resumed_by_reason": reasons,
        "token_identical": sum(identical),
        "token_identical_checked": len(identical),
        "control_identical": sum(control_identical),
        "control_checked": len(control_identical),
        "seam_added_ms_p50": seams["p50"],
        "seam_added_ms_p99": seams["p99"],
        "seam_added_ms_by_reason": {
            r: {k: v for k, v in distribution_ms(v).items() if k in ("p50", "p99")}
            for r, v in by_reason.items()
        },
    }
