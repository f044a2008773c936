"""Golden SGLang command lines: the exact argv and environment for representative fleets."""

from __future__ import annotations

import json

import pytest

from gateway.config import EngineSpec
from gateway.errors import normalize_error_body
from gateway.fleet.engines import get_adapter
from gateway.fleet.engines.base import BOOTSTRAP_PORT, ReplicaSlot, kv_events_ipc_dir
from gateway.fleet.launcher import plan_fleet
from gateway.fleet.ports import release_ports

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
sglang = get_adapter("sglang")
LAUNCH = ["python3", "-m", "sglang.launch_server", "--model-path", MODEL, "--host", "127.0.0.1"]


def spec(**kw: object) -> EngineSpec:
    return EngineSpec(kind="sglang", **kw)  # type: ignore[arg-type]


def slot(**kw: object) -> ReplicaSlot:
    base: dict[str, object] = {"index": 0, "name": "s-0", "role": "mixed", "host": "127.0.0.1", "port": 30000}
    return ReplicaSlot(**(base | kw))  # type: ignore[arg-type]


def test_fp8_chunked_prefill_priority_kv_events() -> None:
    s = spec(
        kv_cache_dtype="fp8",
        chunked_prefill={"enabled": True, "max_num_batched_tokens": 8192},
        max_num_seqs=128,
        priority_scheduling=True,
        kv_events=True,
        extra_args=["--attention-backend", "fa3"],
    )
    one = slot(gpu_ids=(0,), kv_events=True)
    argv, env = sglang.command(s, MODEL, one)
    # SGLang's publisher binds and connects as vLLM's does; its pages must be precise mode's blocks.
    events = f'"endpoint":"ipc://{kv_events_ipc_dir()}/kv-30000.sock","topic":"kv-events"}}'
    assert argv == [
        *LAUNCH, "--port", "30000",
        "--kv-cache-dtype", "fp8_e4m3",
        "--chunked-prefill-size", "8192",
        "--page-size", "16",
        "--max-running-requests", "128",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq",' + events,
        "--schedule-policy", "fcfs", "--enable-priority-scheduling",
        "--enable-metrics", "--enable-cache-report",
        "--attention-backend", "fa3",
    ]  # fmt: skip
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_features_off() -> None:
    s = spec(chunked_prefill={"enabled": False}, prefix_caching=False, block_size=16, max_model_len=4096)
    argv, _ = sglang.command(s, MODEL, slot())
    assert argv == [
        *LAUNCH, "--port", "30000", "--chunked-prefill-size", "-1", "--disable-radix-cache",
        "--page-size", "16", "--context-length", "4096", "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip


def test_pd_prefill_has_its_bootstrap_port_decode_has_none() -> None:
    s = spec(replicas=2, roles={"prefill": 1, "decode": 1}, pd_transfer_backend="mooncake")
    assert sglang.aux_port_names(s, "prefill") == (BOOTSTRAP_PORT,)
    assert sglang.aux_port_names(s, "decode") == ()
    prefill, _ = sglang.command(s, MODEL, slot(role="prefill", aux_ports={BOOTSTRAP_PORT: 8998}))
    assert prefill[9:] == [
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", "8998", "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip
    decode, _ = sglang.command(s, MODEL, slot(role="decode", port=30001))
    assert decode[9:] == [
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
        "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip


def test_pd_fleet_distinct_bootstrap_ports_and_shared_gpu_split() -> None:
    s = spec(replicas=3, roles={"prefill": 2, "decode": 1}, gpu_ids=[[0], [0], [1]], tensor_parallel_size=1)
    plans = plan_fleet("s", s, MODEL)
    try:
        assert [p.role for p in plans] == ["prefill", "prefill", "decode"]
        boots = [p.bootstrap_port for p in plans]
        assert boots[2] is None and boots[0] != boots[1]
        assert all(b is not None and b not in (p.port for p in plans) for b in boots[:2])
        for plan in plans[:2]:
            i = plan.argv.index("--mem-fraction-static")
            assert plan.argv[i + 1] == "0.44"
        assert "--mem-fraction-static" not in plans[2].argv
    finally:
        release_ports([port for p in plans for port in p.ports])


def test_kv_cache_memory_bytes_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        sglang.command(spec(kv_cache_memory_bytes=2**30), MODEL, slot())


def test_removed_vllm_flags_and_plain_fp8_never_emitted() -> None:
    argv, _ = sglang.command(spec(kv_cache_dtype="fp8", kv_events=False), MODEL, slot())
    assert "fp8" not in argv and "--swap-space" not in argv
    assert json.dumps(argv).count("fp8_e4m3") == 1


def test_priority_direction_and_protocol() -> None:
    # Gateway levels: higher is more important; SGLang runs higher values first.
    assert sglang.engine_priority(2) > sglang.engine_priority(1) > sglang.engine_priority(0)
    assert sglang.connector is not None and sglang.connector.protocol == "sglang-bootstrap-concurrent"
    assert sglang.load_path == "/v1/loads"


def test_flat_error_becomes_openai_error() -> None:
    flat = b'{"object":"error","message":"prompt too long","type":"BadRequestError","param":null,"code":400}'
    assert json.loads(normalize_error_body(flat, 400)) == {
        "error": {
            "message": "prompt too long",
            "type": "invalid_request_error",
            "param": None,
            "code": "bad_request",
        }
    }


def test_lora_flags() -> None:
    lora = {
        "modules": [{"name": "sql", "path": "/adapters/sql"}, {"name": "fr", "path": "/adapters/fr"}],
        "max_loras": 4,
        "max_lora_rank": 64,
        "max_cpu_loras": 16,
        "runtime_updates": True,  # SGLang's /load_lora_adapter needs no switch
    }
    argv, env = sglang.command(spec(lora=lora), MODEL, slot())
    assert argv == [
        *LAUNCH, "--port", "30000",
        "--enable-lora", "--lora-paths", "sql=/adapters/sql", "fr=/adapters/fr",
        "--max-loras-per-batch", "4", "--max-lora-rank", "64", "--max-loaded-loras", "16",
        "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip
    assert env == {}
    assert sglang.lora_load_path == "/load_lora_adapter"
