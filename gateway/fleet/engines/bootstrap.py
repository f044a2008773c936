"""SGLang's bootstrap hand-off, concurrent (`sglang-bootstrap-concurrent`): one body naming the
prefill replica's bootstrap host, port and room goes to both legs at once; the decode engine meets
the prefill engine in that room for the KV, and the decode leg's answer is relayed. A batched
completion takes one room per prompt.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, ClassVar, TypeGuard
from urllib.parse import urlsplit

from gateway.fleet.engines.connector import Connector, DecodeLeg
from gateway.fleet.replica import Replica

SGLANG_CONCURRENT = "sglang-bootstrap-concurrent"


def _is_batch(prompt: Any) -> TypeGuard[list[Any]]:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


class BootstrapConnector(Connector):
    protocol: ClassVar[str] = SGLANG_CONCURRENT
    concurrent: ClassVar[bool] = True
    control_fields: ClassVar[frozenset[str]] = frozenset(
        {"bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"}
    )

    def prefill_body(
        self, body: Mapping[str, Any], prefill: Replica, room: int | None = None
    ) -> dict[str, Any]:
        if prefill.bootstrap_port is None:
            raise ValueError(f"prefill replica {prefill.name} has no bootstrap port")
        room = random.getrandbits(63) if room is None else room
        prompts = body.get("prompt")
        rooms: int | list[int] = [room + i for i in range(len(prompts))] if _is_batch(prompts) else room
        host = urlsplit(prefill.url).hostname or "127.0.0.1"
        return {
            **body,
            "bootstrap_host": host,
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": rooms,
        }

    def decode_body(
        self, body: Mapping[str, Any], prefill: Replica, prefill_leg: dict[str, Any], answer: bytes | None
    ) -> DecodeLeg:
        return DecodeLeg(prefill_leg)  # the same room: both engines meet there
