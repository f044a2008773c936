"""The simulator's command line: vLLM's flags plus the simulator's own; of the GPU plumbing, only a
shared GPU's memory split and speed share (`--gpu-share`)."""

from __future__ import annotations

import sys

import pytest

from gateway.config import EngineSpec
from gateway.fleet.engines import adapter_for_spec, get_adapter
from gateway.fleet.engines.base import BOOTSTRAP_PORT, ReplicaSlot
from gateway.fleet.launcher import plan_fleet
from gateway.fleet.ports import release_ports
from tests.fleet.engines.test_vllm_cmdline import PRODUCER_RECOMPUTE

sim = get_adapter("sim")


def slot(**kw: object) -> ReplicaSlot:
    base: dict[str, object] = {"index": 0, "name": "m-0", "role": "mixed", "host": "127.0.0.1", "port": 9100}
    return ReplicaSlot(**(base | kw))  # type: ignore[arg-type]


def test_sim_argv_uses_vllm_flags_and_own_options() -> None:
    s = EngineSpec(
        kind="sim",
        replicas=2,
        roles={"prefill": 1, "decode": 1},
        kv_cache_dtype="fp8",
        chunked_prefill={"max_num_batched_tokens": 4096},
        max_num_seqs=64,
        priority_scheduling=True,
        gpu_ids=[[0], [0]],
        kv_cache_memory_bytes=10**9,
        sim={"profile": "h200-llama3.1-8b", "speedup": 20, "max_waiting": 50, "extra_args": ["--seed", "1"]},
    )
    argv, env = sim.command(s, "llama", slot(role="prefill", gpu_ids=(0,), gpu_sharers=2))
    assert argv == [
        sys.executable, "-m", "gateway.sim", "--model", "llama", "--host", "127.0.0.1", "--port", "9100",
        "--enable-request-id-headers",
        "--kv-cache-dtype", "fp8", "--enable-chunked-prefill", "--max-num-batched-tokens", "4096",
        "--enable-prefix-caching", "--max-num-seqs", "64", "--kv-cache-memory-bytes", "1000000000",
        "--gpu-memory-utilization", "0.46", "--gpu-share", "2",
        "--kv-transfer-config", PRODUCER_RECOMPUTE,
        "--scheduling-policy", "priority",
        "--profile", "h200-llama3.1-8b", "--speedup", "20", "--max-waiting", "50", "--seed", "1",
    ]  # fmt: skip
    # No CUDA_VISIBLE_DEVICES and no side-channel port; the host its prefill answers name, as vLLM's.
    assert env == {"PYTHONUNBUFFERED": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    assert sim.aux_port_names(s, "prefill") == ()


def test_sim_replicas_on_one_gpu_get_a_share_of_it() -> None:
    s = EngineSpec(kind="sim", replicas=3, gpu_ids=[[0], [0], [1]], gpu_memory_utilization=0.8)
    plans = plan_fleet("p", s, "m")
    try:
        shared = ["0.4", "--gpu-share", "2"]
        for plan, tail in zip(plans, (shared, shared, ["0.8"]), strict=True):
            assert plan.argv[plan.argv.index("--gpu-memory-utilization") + 1 :][: len(tail)] == tail
            assert "CUDA_VISIBLE_DEVICES" not in plan.env
        assert "--gpu-share" not in plans[2].argv
    finally:
        release_ports([p for plan in plans for p in plan.ports])


def test_sim_refuses_in_process_replica_groups() -> None:
    s = EngineSpec(kind="sim", sim={"extra_args": ["--replicas", "3"]})
    with pytest.raises(ValueError, match="--replicas"):
        sim.command(s, "m", slot())


def test_sim_speaking_sglang_is_read_the_sglang_way() -> None:
    s = EngineSpec(
        kind="sim", replicas=2, roles={"prefill": 1, "decode": 1}, sim={"extra_args": ["--api", "sglang"]}
    )
    adapter = adapter_for_spec(s)
    assert adapter.connector is not None and adapter.connector.protocol == "sglang-bootstrap-concurrent"
    assert adapter.engine_priority(2) > adapter.engine_priority(0)
    assert adapter.aux_port_names(s, "prefill") == (BOOTSTRAP_PORT,)
    argv, _ = adapter.command(s, "m", slot(role="prefill", aux_ports={BOOTSTRAP_PORT: 8998}))
    assert argv[argv.index("--disaggregation-mode") :] == [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "8998",
        "--profile", "h200-llama3.1-8b", "--speedup", "1", "--api", "sglang",
    ]  # fmt: skip
    assert "--kv-transfer-config" not in argv
    assert "--enable-request-id-headers" not in argv  # vLLM's: SGLang echoes no request id
    assert adapter_for_spec(EngineSpec(kind="sim")) is sim


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="sglang"):
        get_adapter("tgi")


def test_sim_takes_vllms_lora_flags_and_environment() -> None:
    lora = {"modules": [{"name": "sql", "path": "/adapters/sql"}], "max_loras": 2, "runtime_updates": True}
    argv, env = sim.command(EngineSpec(kind="sim", lora=lora), "m", slot())
    flags = argv[argv.index("--enable-lora") : argv.index("--profile")]
    assert flags == ["--enable-lora", "--lora-modules", "sql=/adapters/sql", "--max-loras", "2"]
    assert env == {"PYTHONUNBUFFERED": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
