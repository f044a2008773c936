"""A prefill/decode connector: how an engine kind hands a prompt's KV from a prefill replica to a
decode replica, as bodies in and out (the request path does the sending, `gateway.path.handoff`).

Two shapes exist. Sequential (vLLM's NIXL): the prefill leg is sent first and its answer says where
the decode leg fetches the KV. Concurrent (SGLang's bootstrap): one body naming the prefill
replica's bootstrap room goes to both legs at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.fleet.replica import Replica


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """The decode leg's body, or None and why (None, None: the prefill gave nothing to hand off):
    the decode replica then serves the request whole."""

    body: dict[str, Any] | None
    refused: str | None = None


class Connector(ABC):
    protocol: ClassVar[str]
    concurrent: ClassVar[bool]  # both legs at once; else the prefill leg's answer comes first
    # The decode replica waits for the KV without a deadline of its own (vLLM's decode leg waits on
    # the NIXL fetch; a stopped prefill held requests until their clients gave up, on the H200): the
    # path stops waiting once the prefill replica is ejected, and an error before any text of the
    # answer means the KV did not load.
    waits_for_kv: ClassVar[bool] = False
    # Body fields that steer a hand-off: only the gateway may set them.
    control_fields: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def prefill_body(self, body: Mapping[str, Any], prefill: Replica) -> dict[str, Any]:
        """The prefill leg's body for a client's `body` (the engines' model named in it)."""

    @abstractmethod
    def decode_body(
        self, body: Mapping[str, Any], prefill: Replica, prefill_leg: dict[str, Any], answer: bytes | None
    ) -> DecodeLeg:
        """The decode leg's body: from the prefill leg's `answer` (sequential), or from the prefill
        leg itself (concurrent; `answer` is None, nothing has been sent yet)."""

    def kv_fetch_failed(self, status: int) -> bool:
        """Whether a decode leg's answer status says that its KV could not be fetched (the decode
        replica can then serve the request whole)."""
        return False
