"""The prefill/decode connectors, as data in and out: vLLM's NIXL relay and SGLang's bootstrap."""

from __future__ import annotations

import orjson
import pytest

from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.engines.bootstrap import BootstrapConnector
from gateway.fleet.engines.nixl import NixlConnector
from gateway.fleet.replica import Replica

BODY = {
    "model": "m",
    "prompt": "hi",
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "min_tokens": 8,
}


def replica(url: str = "http://10.1.2.3:8000", **kw: object) -> Replica:
    return Replica("p0", url, "p", role="prefill", breaker=CircuitBreaker(3, 1.0), **kw)  # type: ignore[arg-type]


def kv_answer(**kv: object) -> bytes:
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [1],
        "remote_port": 5600,
    }
    return orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {**params, **kv}})


def test_a_nixl_prefill_leg_is_one_token_not_streamed_and_asks_for_a_remote_decode() -> None:
    leg = NixlConnector().prefill_body(BODY, replica())
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg  # vLLM refuses them without a stream
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert BODY["max_tokens"] == 64  # the client's body is untouched


def test_a_nixl_decode_leg_carries_the_prefill_answers_params_from_its_own_side_channel() -> None:
    nixl = NixlConnector()
    prefill = replica(kv_side_channel_host="10.1.2.3")
    leg = nixl.prefill_body(BODY, prefill)
    decode = nixl.decode_body(BODY, prefill, leg, kv_answer(remote_host="10.1.2.3"))
    assert decode.body is not None and decode.refused is None
    assert decode.body["kv_transfer_params"]["remote_host"] == "10.1.2.3"
    assert decode.body["stream"] is True and decode.body["max_tokens"] == 64  # the client's own request
    # One engine does not steer another: a prefill naming another host hands nothing over.
    steered = nixl.decode_body(BODY, prefill, leg, kv_answer(remote_host="10.9.9.9"))
    assert steered.body is None and steered.refused is not None and "10.9.9.9" in steered.refused
    # An answer without transfer params (or not JSON): the decode replica prefills itself.
    for answer in (orjson.dumps({"choices": []}), b"not json", b"[]"):
        assert nixl.decode_body(BODY, prefill, leg, answer).body is None


def test_a_nixl_prefill_names_its_own_host_and_a_port_of_its_own() -> None:
    nixl = NixlConnector()
    leg = nixl.prefill_body(BODY, replica())
    # No host given: the replica's URL's is its side channel's.
    assert nixl.decode_body(BODY, replica(), leg, kv_answer(remote_host="10.1.2.3")).body is not None
    assert nixl.decode_body(BODY, replica(), leg, kv_answer(remote_host="127.0.0.1")).body is None
    for port in ("5600", 0, 70000, True, None):
        assert (
            nixl.decode_body(BODY, replica(), leg, kv_answer(remote_host="10.1.2.3", remote_port=port)).body
            is None
        )
    launched = replica(kv_side_channel_host="10.1.2.3", kv_side_channel_ports=range(5600, 5602))
    assert nixl.decode_body(BODY, launched, leg, kv_answer(remote_host="10.1.2.3", remote_port=5601)).body
    assert (
        nixl.decode_body(BODY, launched, leg, kv_answer(remote_host="10.1.2.3", remote_port=5602)).body
        is None
    )


def test_a_nixl_decode_leg_that_could_not_fetch_its_kv_answers_500() -> None:
    nixl = NixlConnector()
    assert nixl.kv_fetch_failed(500) and not nixl.kv_fetch_failed(503) and not nixl.kv_fetch_failed(400)
    assert nixl.waits_for_kv and not nixl.concurrent


def test_a_bootstrap_leg_names_the_prefill_replicas_room_and_both_legs_carry_it() -> None:
    boot = BootstrapConnector()
    prefill = replica(bootstrap_port=8998)
    leg = boot.prefill_body(BODY, prefill, room=7)
    assert (leg["bootstrap_host"], leg["bootstrap_port"], leg["bootstrap_room"]) == ("10.1.2.3", 8998, 7)
    assert boot.decode_body(BODY, prefill, leg, None).body is leg  # the same room for both legs
    batch = boot.prefill_body({**BODY, "prompt": ["a", "b", "c"]}, prefill, room=100)
    assert batch["bootstrap_room"] == [100, 101, 102]  # one room per prompt
    ids = boot.prefill_body({**BODY, "prompt": [1, 2, 3]}, prefill, room=100)
    assert ids["bootstrap_room"] == 100  # one prompt of token ids
    assert 0 <= boot.prefill_body(BODY, prefill)["bootstrap_room"] < 2**63
    assert boot.concurrent and not boot.waits_for_kv and not boot.kv_fetch_failed(500)


def test_a_bootstrap_leg_needs_the_prefill_replicas_bootstrap_port() -> None:
    with pytest.raises(ValueError, match="no bootstrap port"):
        BootstrapConnector().prefill_body(BODY, replica())
