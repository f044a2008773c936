"""The bundled simulator (`python -m gateway.sim`): launched with vLLM's flags, like a real engine.

The simulator accepts `vllm serve`'s flags for what it models, so its command line is vLLM's
(exercising the same code path) minus what only a GPU needs (CUDA_VISIBLE_DEVICES, memory
fractions, the NIXL side channel), plus `--profile`, `--speedup`, `--max-waiting` and
`sim.extra_args`. Flags as of the simulator in this repository (mirrors vLLM 0.33).

One process per replica: a crash then takes down, and restarts, exactly one replica. The
simulator's own `--replicas N` (N servers in one process) is refused in `sim.extra_args` because
the launcher supervises processes, not ports. `--api sglang` in `sim.extra_args` makes the
simulator speak SGLang's API: the adapter then reads load, priority and PD protocol the SGLang way.
"""

from __future__ import annotations

import sys
from typing import ClassVar, Literal

from gateway.config import EngineSpec
from gateway.engine_load import EngineLoad
from gateway.engines.base import BOOTSTRAP_PORT, KV_EVENTS_PORT, ReplicaSlot
from gateway.engines.sglang import SGLangAdapter
from gateway.engines.vllm import VLLMAdapter
from gateway.replica import Role

SimApi = Literal["vllm", "sglang"]


def sim_api(spec: EngineSpec) -> SimApi:
    args = spec.sim.extra_args
    for i, arg in enumerate(args):
        if arg == "--api" and i + 1 < len(args):
            return "sglang" if args[i + 1] == "sglang" else "vllm"
        if arg.startswith("--api="):
            return "sglang" if arg.split("=", 1)[1] == "sglang" else "vllm"
    return "vllm"


class SimAdapter(VLLMAdapter):
    kind: ClassVar[str] = "sim"
    uses_gpus: ClassVar[bool] = False

    def __init__(self, api: SimApi = "vllm") -> None:
        self.api: SimApi = api
        if api == "sglang":
            self._sglang = SGLangAdapter()
            self.pd_protocol = SGLangAdapter.pd_protocol
            self.load_path = SGLangAdapter.load_path

    def executable(self, spec: EngineSpec, model: str) -> list[str]:
        return [*(spec.command or [sys.executable, "-m", "gateway.sim"]), "--model", model]

    def aux_port_names(self, spec: EngineSpec, role: Role) -> tuple[str, ...]:
        names = [KV_EVENTS_PORT] if spec.kv_events else []
        if self.api == "sglang" and role == "prefill":
            names.append(BOOTSTRAP_PORT)
        return tuple(names)

    def command(
        self, spec: EngineSpec, model: str, slot: ReplicaSlot, served_model_name: str | None = None
    ) -> tuple[list[str], dict[str, str]]:
        if any(a == "--replicas" or a.startswith("--replicas=") for a in spec.sim.extra_args):
            raise ValueError(
                "sim.extra_args: --replicas is not supported under the launcher "
                "(it runs one process per replica); set engines.replicas instead"
            )
        argv, env = super().command(spec, model, slot, served_model_name)
        argv += ["--profile", spec.sim.profile, "--speedup", f"{spec.sim.speedup:g}"]
        if spec.sim.max_waiting is not None:
            argv += ["--max-waiting", str(spec.sim.max_waiting)]
        if BOOTSTRAP_PORT in slot.aux_ports:
            argv += ["--disaggregation-bootstrap-port", str(slot.aux_ports[BOOTSTRAP_PORT])]
        argv += spec.sim.extra_args
        # Unbuffered, so a crashing simulator's last words reach its log file.
        return argv, {"PYTHONUNBUFFERED": "1"} | env

    def memory_args(self, spec: EngineSpec, slot: ReplicaSlot) -> list[str]:
        return []

    def gpu_env(self, slot: ReplicaSlot) -> dict[str, str]:
        return {}

    def parse_load(self, body: bytes) -> EngineLoad:
        if self.api == "sglang":
            return self._sglang.parse_load(body)
        return super().parse_load(body)

    def engine_priority(self, level: int) -> int:
        if self.api == "sglang":
            return self._sglang.engine_priority(level)
        return super().engine_priority(level)
