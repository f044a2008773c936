"""Golden vLLM command lines: the exact argv and environment for representative fleets."""

from __future__ import annotations

import json

import pytest

from gateway.config import EngineSpec
from gateway.fleet.engines import get_adapter
from gateway.fleet.engines.base import (
    KV_EVENTS_PORT,
    KV_EVENTS_TOPIC,
    NIXL_SIDE_CHANNEL_PORT,
    ReplicaSlot,
    kv_events_ipc_dir,
)
from gateway.fleet.launcher import plan_fleet
from gateway.fleet.ports import release_ports

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
vllm = get_adapter("vllm")


PRODUCER_RECOMPUTE = (
    '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":"recompute"}'
)


def spec(**kw: object) -> EngineSpec:
    return EngineSpec(kind="vllm", **kw)  # type: ignore[arg-type]


def slot(**kw: object) -> ReplicaSlot:
    base: dict[str, object] = {"index": 0, "name": "p-0", "role": "mixed", "host": "127.0.0.1", "port": 8100}
    return ReplicaSlot(**(base | kw))  # type: ignore[arg-type]


@pytest.fixture
def fleet():
    made: list[list] = []

    def plan(s: EngineSpec, name: str = "p") -> list:
        plans = plan_fleet(name, s, MODEL)
        made.append(plans)
        return plans

    yield plan
    release_ports([p for plans in made for plan in plans for p in plan.ports])


def test_fp8_chunked_prefill_prefix_caching_priority() -> None:
    s = spec(
        kv_cache_dtype="fp8",
        chunked_prefill={"enabled": True, "max_num_batched_tokens": 8192},
        max_num_seqs=256,
        max_model_len=8192,
        priority_scheduling=True,
    )
    argv, env = vllm.command(s, MODEL, slot(gpu_ids=(0,)))
    assert argv == [
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8100", "--enable-request-id-headers",
        "--kv-cache-dtype", "fp8",
        "--enable-chunked-prefill", "--max-num-batched-tokens", "8192",
        "--enable-prefix-caching",
        "--max-num-seqs", "256", "--max-model-len", "8192",
        "--scheduling-policy", "priority",
    ]  # fmt: skip
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_features_off_and_passthrough() -> None:
    s = spec(
        kv_cache_dtype="bf16",
        chunked_prefill={"enabled": False},
        prefix_caching=False,
        block_size=32,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.85,
        extra_args=["--enforce-eager"],
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
        command=["/opt/vllm/bin/vllm", "serve"],
    )
    argv, env = vllm.command(s, "/models/llama", slot(gpu_ids=(2, 3)), served_model_name="llama")
    assert argv == [
        "/opt/vllm/bin/vllm", "serve", "/models/llama", "--host", "127.0.0.1", "--port", "8100",
        "--enable-request-id-headers",
        "--served-model-name", "llama", "--tensor-parallel-size", "2", "--kv-cache-dtype", "bfloat16",
        "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--block-size", "32",
        "--gpu-memory-utilization", "0.85", "--enforce-eager",
    ]  # fmt: skip
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "VLLM_LOGGING_LEVEL": "DEBUG"}


def test_pd_prefill_producer_with_nixl_side_channel() -> None:
    s = spec(replicas=2, roles={"prefill": 1, "decode": 1}, kv_cache_dtype="fp8")
    argv, env = vllm.command(
        s, MODEL, slot(role="prefill", gpu_ids=(0,), aux_ports={NIXL_SIDE_CHANNEL_PORT: 5600})
    )
    assert argv == [
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8100",
        "--enable-request-id-headers", "--kv-cache-dtype", "fp8",
        "--enable-chunked-prefill", "--enable-prefix-caching",
        "--kv-transfer-config", PRODUCER_RECOMPUTE,
    ]  # fmt: skip
    assert env == {
        "CUDA_VISIBLE_DEVICES": "0",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }


def test_pd_decode_consumer_with_mooncake() -> None:
    s = spec(replicas=2, roles={"prefill": 1, "decode": 1}, pd_transfer_backend="mooncake")
    assert vllm.aux_port_names(s, "decode") == ()
    argv, env = vllm.command(s, MODEL, slot(role="decode", gpu_ids=(1,)))
    assert argv[-2:] == [
        "--kv-transfer-config",
        '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute"}',
    ]
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}


def test_pd_fleet_gets_distinct_side_channel_ports(fleet) -> None:
    plans = fleet(spec(replicas=3, roles={"prefill": 1, "decode": 2}))
    assert [p.role for p in plans] == ["prefill", "decode", "decode"]
    assert [p.name for p in plans] == ["p-0", "p-1", "p-2"]
    side = [p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for p in plans]
    assert len(set(side)) == 3
    every_port = [port for p in plans for port in p.ports]
    assert len(set(every_port)) == len(every_port) == 6
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "1", "2"]
    assert all(p.bootstrap_port is None for p in plans)


def test_replicas_sharing_a_gpu_get_explicit_kv_bytes_and_a_split_fraction(fleet) -> None:
    plans = fleet(spec(replicas=3, gpu_ids=[[0], [0], [1]], kv_cache_memory_bytes=20 * 2**30))
    shared = ["--kv-cache-memory-bytes", str(20 * 2**30), "--gpu-memory-utilization", "0.46"]
    assert plans[0].argv[-4:] == shared
    assert plans[1].argv[-4:] == shared
    # Alone on GPU 1: only its KV budget, vLLM's own utilization default stands.
    assert plans[2].argv[-2:] == ["--kv-cache-memory-bytes", str(20 * 2**30)]
    assert "--gpu-memory-utilization" not in plans[2].argv
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "0", "1"]


def test_replicas_sharing_a_gpu_split_the_configured_utilization(fleet) -> None:
    plans = fleet(spec(replicas=2, gpu_ids=[[0], [0]], gpu_memory_utilization=0.9))
    for plan in plans:
        assert plan.argv[-2:] == ["--gpu-memory-utilization", "0.45"]
        assert "--kv-cache-memory-bytes" not in plan.argv


def test_default_gpu_layout_gives_each_replica_its_own_gpus(fleet) -> None:
    plans = fleet(spec(replicas=2, tensor_parallel_size=2))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1", "2,3"]
    assert all("--gpu-memory-utilization" not in p.argv for p in plans)


def test_kv_events_bind_a_private_unix_socket_per_loopback_replica(fleet) -> None:
    """vLLM's publisher binds only `*`, `::` or ipc:// endpoints (it CONNECTS to tcp://127.0.0.1:P,
    where nobody listens): a loopback replica binds a Unix socket in a directory only this user
    can enter, and the gateway subscribes to that same socket with the topic set explicitly."""
    plans = fleet(spec(replicas=2, kv_events=True))
    configs = [json.loads(p.argv[p.argv.index("--kv-events-config") + 1]) for p in plans]
    endpoints = set()
    for plan, config in zip(plans, configs, strict=True):
        assert config["enable_kv_cache_events"] is True
        assert config["publisher"] == "zmq" and config["topic"] == KV_EVENTS_TOPIC
        assert config["endpoint"] == plan.kv_events_endpoint
        assert config["endpoint"] == f"ipc://{kv_events_ipc_dir()}/kv-{plan.port}.sock"
        endpoints.add(config["endpoint"])
    assert len(endpoints) == 2
    assert all(p.ports == (p.port,) for p in plans)  # no TCP port for the events


def test_a_replica_bound_wider_binds_events_on_a_wildcard_and_is_reached_at_its_host() -> None:
    for host, reach in (("0.0.0.0", "127.0.0.1"), ("10.0.0.5", "10.0.0.5")):
        s = spec(host=host, kv_events=True)
        assert vllm.aux_port_names(s, "mixed") == (KV_EVENTS_PORT,)
        one = slot(host=host, aux_ports={KV_EVENTS_PORT: 5557}, kv_events=True)
        argv, _ = vllm.command(s, MODEL, one)
        assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:5557"
        assert one.kv_events_endpoint == f"tcp://{reach}:5557"


def test_base_port_gives_repeatable_ports(fleet) -> None:
    from gateway.fleet.ports import reserve_free_port

    # Four consecutive ports (two replicas, two NIXL side channels) that nothing else holds now:
    # a fixed start such as 39000 collides with whatever else runs on the machine.
    base = reserve_free_port("127.0.0.1", count=4)
    release_ports(list(range(base, base + 4)))
    plans = fleet(spec(replicas=2, base_port=base, roles={"prefill": 1, "decode": 1}))
    assert [p.port for p in plans] == [base, base + 1]
    assert [port for p in plans for port in p.ports[1:]] == [base + 2, base + 3]  # NIXL side channels


def test_removed_flags_never_emitted(fleet) -> None:
    s = spec(
        replicas=2,
        roles={"prefill": 1, "decode": 1},
        kv_cache_dtype="fp8",
        kv_events=True,
        priority_scheduling=True,
        gpu_ids=[[0], [0]],
        kv_cache_memory_bytes=2**30,
    )
    for plan in fleet(s):
        assert not {"--swap-space", "--calculate-kv-scales"} & set(plan.argv)


def test_priority_direction_and_protocol() -> None:
    # Gateway levels: higher is more important; vLLM runs lower values first.
    assert vllm.engine_priority(2) < vllm.engine_priority(1) < vllm.engine_priority(0)
    assert vllm.connector is not None and vllm.connector.protocol == "vllm-nixl-sequential"
    assert vllm.load_path == "/metrics"


def test_nixl_side_channel_reserves_a_port_per_tensor_parallel_rank(fleet) -> None:
    plans = fleet(spec(replicas=2, tensor_parallel_size=2, roles={"prefill": 1, "decode": 1}))
    firsts = [int(p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for p in plans]
    for plan, first in zip(plans, firsts, strict=True):
        assert plan.ports[1:] == (first, first + 1)
    assert abs(firsts[0] - firsts[1]) >= 2


def test_lora_flags_and_runtime_updating() -> None:
    lora = {
        "modules": [
            {"name": "sql", "path": "/adapters/sql"},
            {"name": "fr", "path": "/adapters/fr", "base_model_name": "llama"},
        ],
        "max_loras": 4,
        "max_lora_rank": 64,
        "max_cpu_loras": 16,
        "runtime_updates": True,
    }
    argv, env = vllm.command(spec(lora=lora, prefix_caching=False), MODEL, slot(gpu_ids=(0,)))
    assert argv == [
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8100", "--enable-request-id-headers",
        "--enable-chunked-prefill", "--no-enable-prefix-caching",
        "--enable-lora", "--lora-modules", "sql=/adapters/sql",
        '{"name":"fr","path":"/adapters/fr","base_model_name":"llama"}',
        "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "16",
    ]  # fmt: skip
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    argv, env = vllm.command(spec(lora={}), MODEL, slot())
    assert argv[-1] == "--enable-lora" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert vllm.lora_load_path == "/v1/load_lora_adapter"


def test_kv_offload_is_written_as_vllms_offloading_flags() -> None:
    argv, _ = vllm.command(spec(kv_offload={"size_gib": 20}), MODEL, slot())
    assert argv[-4:] == ["--kv-offloading-backend", "native", "--kv-offloading-size", "20"]
    argv, _ = vllm.command(spec(kv_offload={"size_bytes": 3 << 29, "backend": "lmcache"}), MODEL, slot())
    assert argv[-4:] == ["--kv-offloading-backend", "lmcache", "--kv-offloading-size", "1.5"]
    for bad in ({}, {"size_gib": 1, "size_bytes": 1 << 30}, {"size_gib": 0}):
        with pytest.raises(ValueError):
            spec(kv_offload=bad)
    with pytest.raises(ValueError, match="not supported for SGLang"):
        get_adapter("sglang").command(EngineSpec(kind="sglang", kv_offload={"size_gib": 4}), MODEL, slot())
