"""Mid-stream failover in a prefill/decode pool: a decode replica lost while streaming, its answer
continued on the other decode replica, through a fresh hand-off since that one lacks the prompt."""

from __future__ import annotations

import httpx
import orjson

from tests.conftest import free_port, gateway_settings
from tests.cut_relay import CutRelay, Trigger
from tests.path.test_pd import CONSUMER, LONG, PRODUCER
from tests.simfleet import seen, sim_fleet, sim_process

START_S = 60.0  # three simulator processes start together, on a machine others load too


def _text(r: httpx.Response) -> tuple[str, dict[str, int] | None]:
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    docs = [orjson.loads(e) for e in events[:-1]]
    assert all("error" not in d for d in docs), docs
    usage = docs[-1].get("usage")
    return "".join(c["text"] for d in docs for c in d["choices"]), usage


async def test_a_decode_replica_lost_mid_stream_is_continued_on_another(gateway) -> None:
    with (
        sim_process(*PRODUCER, timeout=START_S) as prefill,
        sim_fleet(*CONSUMER, replicas=2, timeout=START_S) as decodes,
    ):
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
                p_legs = await seen(prefill)  # the broken answer's, then its continuation's
                whole = await c.post(gw.url + "/v1/completions", json=body)
            legs = [(i, leg) for i, url in enumerate(decodes.urls) for leg in await seen(url)]
        finally:
            for r in relays:
                await r.stop()
    assert [leg["kv_transfer_params"]["do_remote_decode"] for leg in p_legs] == [True, True]
    text, usage = _text(broken)
    assert (text, usage["completion_tokens"]) == (_text(whole)[0], 24)
    # The continuation: the prompt and the text sent up to its last word (none if one word had
    # gone out), prefilled anew and decoded on the other decode replica.
    rid = broken.headers["x-request-id"]
    mine = sorted((leg["received_at"], i, leg) for i, leg in legs if leg["headers"]["x-request-id"] == rid)
    (_, first, _), (_, other, cont) = mine
    assert other != first and cont["kv_transfer_params"]["do_remote_prefill"] is True
    prompt = cont["body"]["prompt"]
    assert prompt == p_legs[1]["body"]["prompt"]
    assert prompt.startswith(LONG) and text.startswith(prompt[len(LONG) :])


async def test_sglang_a_lost_decode_leg_is_continued_through_a_fresh_bootstrap_room(gateway) -> None:
    boot = free_port()
    sglang = ("--api", "sglang")
    with (
        sim_process(
            *sglang, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)
        ) as prefill,
        sim_fleet(*sglang, "--disaggregation-mode", "decode", replicas=2) as decodes,
    ):
        trigger = Trigger()
        relays = [await CutRelay(u, trigger).start() for u in decodes.urls]
        try:
            endpoints = [
                {
                    "url": prefill,
                    "name": "prefill-0",
                    "role": "prefill",
                    "kind": "sglang",
                    "bootstrap_port": boot,
                }
            ] + [
                {"url": r.url, "name": f"decode-{i}", "role": "decode", "kind": "sglang"}
                for i, r in enumerate(relays)
            ]
            pool = {"endpoints": endpoints, "pd": {"min_uncached_tokens": 64}}
            gw = await gateway(gateway_settings([], pool=pool, health={"enabled": False}))
            body = {"model": "m", "prompt": LONG, "max_tokens": 24, "stream": True}
            async with httpx.AsyncClient(timeout=60) as c:
                trigger.arm(900)
                broken = await c.post(gw.url + "/v1/completions", json=body)
                assert trigger.fired == 1
                whole = await c.post(gw.url + "/v1/completions", json=body)
            p_legs = await seen(prefill)
            legs = [(i, leg) for i, url in enumerate(decodes.urls) for leg in await seen(url)]
        finally:
            for r in relays:
                await r.stop()
    rid = broken.headers["x-request-id"]
    mine = sorted((leg["received_at"], i, leg) for i, leg in legs if leg["headers"]["x-request-id"] == rid)
    (_, first, leg0), (_, other, cont) = mine
    rooms = [leg["bootstrap"]["bootstrap_room"] for leg in p_legs if leg["headers"]["x-request-id"] == rid]
    # Each leg pair shares its room, a new one for the continuation, decoded on the other replica.
    assert rooms == [leg0["bootstrap"]["bootstrap_room"], cont["bootstrap"]["bootstrap_room"]]
    assert rooms[0] != rooms[1] and other != first
    assert _text(broken)[0] == _text(whole)[0]
