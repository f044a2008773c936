"""`python -m gateway.sim` as a real process: vLLM command lines, in-process replicas, crash fault."""

from __future__ import annotations

import httpx
import pytest

from gateway.sim.cli import parse_args, replica_options
from tests.simfleet import sim_fleet


def test_vllm_command_line_parses_like_vllm_serve() -> None:
    args = parse_args(
        ["serve", "meta-llama/Llama-3.1-8B", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching",
         "--max-model-len", "8192", "--gpu-memory-utilization", "0.85", "--load-format", "dummy",
         "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}', "--port", "9000"]
    )  # fmt: skip
    [o] = replica_options(args)
    assert o.model == "meta-llama/Llama-3.1-8B" and o.served_model_names == ["meta-llama/Llama-3.1-8B"]
    assert o.engine.kv_cache_dtype == "fp8" and not o.engine.enable_prefix_caching
    assert o.kv_role == "kv_consumer" and o.port == 9000
    sg = replica_options(parse_args(["--api", "sglang", "--kv-transfer-config", '{"kv_role":"kv_producer"}']))
    assert sg[0].disaggregation_mode == "prefill" and sg[0].engine.higher_priority_first
    assert sg[0].bootstrap_port == 8998  # SGLang's default
    eph = replica_options(
        parse_args(["--api", "sglang", "--disaggregation-bootstrap-port", "0", "--replicas", "2"])
    )
    assert [o.bootstrap_port for o in eph] == [0, 0] and eph[0].disaggregation_mode == "prefill"


async def test_replicas_share_a_process_on_consecutive_ports_and_warn_on_unknown_flags() -> None:
    with sim_fleet("--seed", "3", replicas=2) as fleet:
        urls = fleet.urls
        assert len(set(urls)) == 2
        async with httpx.AsyncClient() as c:
            for u in urls:
                assert (await c.get(f"{u}/health")).status_code == 200
            await c.post(f"{urls[0]}/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
            s0 = (await c.get(f"{urls[0]}/sim/state")).json()
            s1 = (await c.get(f"{urls[1]}/sim/state")).json()
            assert s0["counters"]["requests_finished"] == 1 and s1["counters"]["requests_finished"] == 0
        assert b"--seed" in fleet.log.read_bytes()  # warned about at start


async def test_crash_fault_exits_a_single_replica_process() -> None:
    with sim_fleet() as fleet:
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.TransportError):
                await c.post(
                    f"{fleet.url}/v1/completions", json={"prompt": "x"}, headers={"x-sim-fault": "crash"}
                )
        assert fleet.proc.wait(timeout=10) == 17
