"""Any OpenAI-compatible server (`kind: openai`): served as it is, nothing engine-specific assumed.

No prefill/decode hand-off, no continuation of a broken answer (the OpenAI API has no way to ask
for one), no load figures to scrape and no `priority` field; the gateway's own admission, routing
and retries before the first byte still apply. It is never launched: such servers are endpoints.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.config import EngineSpec
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines.base import EngineAdapter, ReplicaSlot
from gateway.fleet.replica import Role


class OpenAIAdapter(EngineAdapter):
    kind: ClassVar[str] = "openai"
    continues: ClassVar[bool] = False
    load_path: str | None = None
    schedules_by_priority: ClassVar[bool] = False

    def aux_port_names(self, spec: EngineSpec, role: Role) -> tuple[str, ...]:
        return ()

    def command(
        self, spec: EngineSpec, model: str, slot: ReplicaSlot, served_model_name: str | None = None
    ) -> tuple[list[str], dict[str, str]]:
        raise ValueError("an OpenAI-compatible server is not launched by kvgate: give it as an endpoint")

    def parse_load(self, body: bytes) -> EngineLoad:
        return EngineLoad()

    def engine_priority(self, level: int) -> int:
        raise ValueError("an OpenAI-compatible server has no `priority` field")
