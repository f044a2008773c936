"""vLLM's NIXL hand-off, sequential (`vllm-nixl-sequential`): the prefill leg is the client's body
as a one-token, non-streaming request with `kv_transfer_params.do_remote_decode`; its answer's
`kv_transfer_params` (remote engine id, block ids, host and port of its NIXL side channel) go into
the decode leg, whose engine fetches the KV from there.

One engine must not steer another: an answer naming a side-channel host other than the prefill
replica's own (the host its engine was given, else its URL's), or a port that is no port or not
one of the replica's own where the launcher set them, is refused, and the decode replica serves
the request whole. A decode leg whose KV
could not be fetched is answered 500 (vLLM's `kv_load_failure_policy: fail`) or, streamed, with an
error event before any text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from gateway.fleet.engines.connector import Connector, DecodeLeg
from gateway.fleet.replica import Replica

VLLM_SEQUENTIAL = "vllm-nixl-sequential"

_NO_REMOTE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class NixlConnector(Connector):
    protocol: ClassVar[str] = VLLM_SEQUENTIAL
    concurrent: ClassVar[bool] = False
    waits_for_kv: ClassVar[bool] = True
    control_fields: ClassVar[frozenset[str]] = frozenset({"kv_transfer_params"})

    def prefill_body(self, body: Mapping[str, Any], prefill: Replica) -> dict[str, Any]:
        leg = dict(body)
        leg["stream"] = False
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg.pop("stream_options", None)  # vLLM rejects stream_options without stream
        leg.pop("min_tokens", None)
        leg["kv_transfer_params"] = dict(_NO_REMOTE)
        return leg

    def decode_body(
        self, body: Mapping[str, Any], prefill: Replica, prefill_leg: dict[str, Any], answer: bytes | None
    ) -> DecodeLeg:
        try:
            kv = orjson.loads(answer or b"").get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            kv = None
        if not isinstance(kv, dict):  # the decode replica then does the full prefill itself
            return DecodeLeg(None)
        expected = prefill.kv_side_channel_host
        if kv.get("remote_host") != expected:
            named = str(kv.get("remote_host"))[:80]
            return DecodeLeg(None, f"named {named!r} for its KV, not its side channel {expected!r}")
        port, ports = kv.get("remote_port"), prefill.kv_side_channel_ports
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            return DecodeLeg(None, f"named port {str(port)[:20]!r} for its KV")
        if ports is not None and port not in ports:
            return DecodeLeg(None, f"named port {port} for its KV, not its side channel's {ports.start}")
        return DecodeLeg({**body, "kv_transfer_params": kv})

    def kv_fetch_failed(self, status: int) -> bool:
        # vLLM fails a decode whose KV it could not fetch with a 500 (kv_load_failure_policy: fail);
        # without the hand-off a decode replica prefills the prompt itself.
        return status == 500
