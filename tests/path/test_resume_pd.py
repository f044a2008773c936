"""Mid-stream failover in a prefill/decode pool: a decode replica lost while streaming, its answer
continued on the other decode replica (which prefills the continuation itself)."""

from __future__ import annotations

import httpx
import orjson

from tests.conftest import gateway_settings
from tests.cut_relay import CutRelay, Trigger
from tests.path.test_pd import CONSUMER, LONG, PRODUCER
from tests.simfleet import seen, sim_fleet, sim_process


def _text(r: httpx.Response) -> tuple[str, dict[str, int]]:
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    docs = [orjson.loads(e) for e in events[:-1]]
    assert all("error" not in d for d in docs), docs
    usage = docs[-1]["usage"]
    return "".join(c["text"] for d in docs for c in d["choices"]), usage


async def test_a_decode_replica_lost_mid_stream_is_continued_on_another(gateway) -> None:
    with sim_process(*PRODUCER) as prefill, sim_fleet(*CONSUMER, replicas=2) as decodes:
        trigger = Trigger()
        relays = [await CutRelay(u, trigger).start() for u in decodes.urls]
        try:
            endpoints = [{"url": prefill, "name": "prefill-0", "role": "prefill"}] + [
                {"url": r.url, "name": f"decode-{i}", "role": "decode"} for i, r in enumerate(relays)
            ]
            pool = {"endpoints": endpoints, "pd": {"min_uncached_tokens": 64}}
            gw = await gateway(gateway_settings([], pool=pool, health={"enabled": False}))
            body = {
                "model": "m",
                "prompt": LONG,
                "max_tokens": 24,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with httpx.AsyncClient(timeout=60) as c:
                trigger.arm(900)  # the decode leg's head and a few events, then a reset
                broken = await c.post(gw.url + "/v1/completions", json=body)
                assert trigger.fired == 1
                (p_leg,) = await seen(prefill)  # the broken answer was disaggregated
                whole = await c.post(gw.url + "/v1/completions", json=body)
            legs = [(i, leg) for i, url in enumerate(decodes.urls) for leg in await seen(url)]
        finally:
            for r in relays:
                await r.stop()
    assert p_leg["kv_transfer_params"]["do_remote_decode"] is True
    text, usage = _text(broken)
    assert (text, usage["completion_tokens"]) == (_text(whole)[0], 24)
    # The continuation: the prompt and the text sent up to its last word (none if one word had
    # gone out), to a decode replica, with no hand-off.
    rid = broken.headers["x-request-id"]
    mine = [(i, leg) for i, leg in legs if leg["headers"]["x-request-id"] == rid]
    ((first, _),) = [(i, leg) for i, leg in mine if leg["kv_transfer_params"] is not None]  # handed off
    ((other, cont),) = [(i, leg) for i, leg in mine if leg["kv_transfer_params"] is None]
    assert other != first  # the other decode replica
    prompt = cont["body"]["prompt"]
    assert prompt.startswith(LONG) and text.startswith(prompt[len(LONG) :])
