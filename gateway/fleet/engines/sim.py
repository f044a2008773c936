"""The bundled simulator (`python -m gateway.sim`): launched with vLLM's flags, like a real engine.

The simulator accepts `vllm serve`'s flags for what it models, so its command line is vLLM's
(exercising the same code path) minus what only a GPU needs (CUDA_VISIBLE_DEVICES, the NIXL side
channel), plus `--profile`, `--speedup`, `--max-waiting` and `sim.extra_args`. An explicit
`gpu_memory_utilization` or `kv_cache_memory_bytes` is passed on: the simulator sizes its KV cache
from them. Replicas that `gpu_ids` puts on one GPU get vLLM's split of its memory and
`--gpu-share N`, a static 1/N of its speed each. Flags as of gateway/sim/cli.py (mirrors vLLM 0.33).

One process per replica: a crash then takes down, and restarts, exactly one replica. The
simulator's own `--replicas N` (N servers in one process) is refused in `sim.extra_args` because
the launcher supervises processes, not ports. `--api sglang` in `sim.extra_args` makes the
simulator speak SGLang's API: PD roles are then given SGLang's way (`--disaggregation-mode`, a
bootstrap port per prefill replica), and load, priority and PD protocol are read the SGLang way.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar, Literal

from gateway.config import EngineSpec
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines.base import (
    BOOTSTRAP_PORT,
    KV_EVENTS_PORT,
    ReplicaSlot,
    connect_host,
    flag_value,
    kv_events_port_needed,
)
from gateway.fleet.engines.sglang import SGLangAdapter
from gateway.fleet.engines.vllm import VLLMAdapter
from gateway.fleet.replica import Role

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
    control_header_prefixes: ClassVar[tuple[str, ...]] = (*VLLMAdapter.control_header_prefixes, "x-sim-")
    hub_tokenizer: ClassVar[bool] = False

    def __init__(self, api: SimApi = "vllm") -> None:
        self.api: SimApi = api
        if api == "sglang":
            self._sglang = SGLangAdapter()
            self.connector = self._sglang.connector
            self.load_path = SGLangAdapter.load_path

    def tokenizer_hint(self, spec: EngineSpec, model: str) -> str | None:
        # The simulator reads a model directory's tokenizer, never a hub cache.
        flag = flag_value([*spec.extra_args, *spec.sim.extra_args], "--tokenizer")
        if flag:
            return flag
        found = Path(model) / "tokenizer.json"
        return str(found) if found.is_file() else None

    def executable(self, spec: EngineSpec, model: str) -> list[str]:
        return [*(spec.command or [sys.executable, "-m", "gateway.sim"]), "--model", model]

    def aux_port_names(self, spec: EngineSpec, role: Role) -> tuple[str, ...]:
        names = [KV_EVENTS_PORT] if kv_events_port_needed(spec) else []
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
        if self.api == "sglang":
            argv.remove("--enable-request-id-headers")  # vLLM's flag: SGLang echoes no request id
        argv += ["--profile", spec.sim.profile, "--speedup", f"{spec.sim.speedup:g}"]
        if spec.sim.max_waiting is not None:
            argv += ["--max-waiting", str(spec.sim.max_waiting)]
        argv += spec.sim.extra_args
        if self.api == "vllm" and slot.role != "mixed":
            # As vLLM's: the host its prefill answers name for the KV (it serves the lease on its
            # HTTP port, so no side-channel port of its own).
            env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", connect_host(slot.host))
        # Unbuffered, so a crashing simulator's last words reach its log file.
        return argv, {"PYTHONUNBUFFERED": "1"} | env

    def pd_args(self, spec: EngineSpec, slot: ReplicaSlot) -> list[str]:
        if self.api == "vllm":
            return super().pd_args(spec, slot)
        args = ["--disaggregation-mode", slot.role]
        if BOOTSTRAP_PORT in slot.aux_ports:
            args += ["--disaggregation-bootstrap-port", str(slot.aux_ports[BOOTSTRAP_PORT])]
        return args

    def memory_args(self, spec: EngineSpec, slot: ReplicaSlot) -> list[str]:
        if slot.gpu_sharers > 1:
            # Replicas that `gpu_ids` puts on one GPU split its memory as vLLM's would, and each gets a
            # static share of its speed (`--gpu-share`: one process per replica, they cannot see each other).
            return [*super().memory_args(spec, slot), "--gpu-share", str(slot.gpu_sharers)]
        # Otherwise each simulated replica models a GPU of its own: nothing to split.
        args: list[str] = []
        if spec.kv_cache_memory_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
        if spec.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:g}"]
        return args

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
