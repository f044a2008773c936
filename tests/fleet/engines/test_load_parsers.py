"""Engine load parsers against realistic vLLM and SGLang output."""
# ruff: noqa: E501  (verbatim exposition lines are as long as the engines make them)

from __future__ import annotations

import json

import pytest

from gateway.fleet.engines import get_adapter

VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12718.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 37.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",reason="capacity"} 99.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4172
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.048576e+06
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 812.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 812.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 41.2
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.85",num_cpu_blocks="None",num_gpu_blocks="52478",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"""

SGLANG_METRICS = """\
# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 161721.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.61
"""


def test_vllm_metrics() -> None:
    load = get_adapter("vllm").parse_load(VLLM_METRICS.encode())
    assert (load.running, load.waiting) == (37, 5)
    assert load.kv_usage == pytest.approx(0.4172)
    assert (load.num_gpu_blocks, load.block_size) == (52478, 16)
    assert load.kv_capacity_tokens == 839_648
    assert load.updated_at == 0.0  # the scraper stamps it, not the parser


def test_vllm_data_parallel_engines_add_up() -> None:
    second = (
        VLLM_METRICS.replace('engine="0"', 'engine="1"')
        .replace("} 37.0", "} 3.0")
        .replace("} 5.0", "} 1.0")
        .replace("} 0.4172", "} 0.2")
    )
    text = VLLM_METRICS + "\n".join(line for line in second.splitlines() if not line.startswith("#"))
    load = get_adapter("vllm").parse_load(text.encode())
    assert (load.running, load.waiting) == (40, 6)
    assert load.kv_usage == pytest.approx((0.4172 + 0.2) / 2)
    assert load.num_gpu_blocks == 2 * 52478


def test_vllm_before_profiling_has_no_capacity() -> None:
    text = VLLM_METRICS.replace('num_gpu_blocks="52478"', 'num_gpu_blocks="None"')
    load = get_adapter("vllm").parse_load(text.encode())
    assert load.num_gpu_blocks is None and load.kv_capacity_tokens is None
    assert load.running == 37


def test_vllm_cpu_tier_capacity_from_its_offloading_size() -> None:
    assert get_adapter("vllm").parse_load(VLLM_METRICS.encode()).cpu_capacity_tokens is None
    # The H200 kit: 12,455,405,158 KV bytes hold 95,024 tokens; 20 GiB more on CPU hold 163,840.
    text = VLLM_METRICS.replace(
        'num_gpu_blocks="52478"',
        'num_gpu_blocks="5939",kv_cache_memory_bytes="12455405158",kv_offloading_size="20.0"',
    )
    load = get_adapter("vllm").parse_load(text.encode())
    assert load.cpu_capacity_tokens == int(20 * 2**30 * 5939 * 16 / 12455405158)
    assert 163_000 < load.cpu_capacity_tokens < 164_000  # type: ignore[operator]
    # Sized by gpu_memory_utilization, the GPU's KV bytes are not in the labels: unknown.
    unsized = text.replace('kv_cache_memory_bytes="12455405158"', 'kv_cache_memory_bytes="None"')
    assert get_adapter("vllm").parse_load(unsized.encode()).cpu_capacity_tokens is None


def test_vllm_unlabelled_series_and_timestamps() -> None:
    text = "vllm:num_requests_running 4 1732870000000\nvllm:num_requests_waiting 2\n"
    load = get_adapter("vllm").parse_load(text.encode())
    assert (load.running, load.waiting, load.kv_usage) == (4, 2, 0.0)


def test_sglang_metrics() -> None:
    load = get_adapter("sglang").parse_load(SGLANG_METRICS.encode())
    assert (load.running, load.waiting) == (12, 3)
    assert load.kv_usage == pytest.approx(0.28)
    assert load.kv_capacity_tokens == 161_721


def test_sglang_v1_loads_json_per_dp_rank() -> None:
    body = {
        "timestamp": "2026-11-29T09:00:00Z",
        "version": "0.5.23",
        "dp_rank_count": 2,
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 7, "num_waiting_reqs": 2, "num_total_reqs": 9,
             "token_usage": 0.5, "num_used_tokens": 80000, "max_total_num_tokens": 160000,
             "cache_hit_rate": 0.4},
            {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 0, "num_total_reqs": 3,
             "token_usage": 0.25, "num_used_tokens": 40000, "max_total_num_tokens": 160000,
             "cache_hit_rate": 0.3},
        ],
        "aggregate": {"total_running_reqs": 10, "total_waiting_reqs": 2},
    }  # fmt: skip
    load = get_adapter("sglang").parse_load(json.dumps(body).encode())
    assert (load.running, load.waiting) == (10, 2)
    assert load.kv_usage == pytest.approx(0.375)
    assert load.kv_capacity_tokens == 320_000


def test_sglang_v1_loads_bare_entry() -> None:
    load = get_adapter("sglang").parse_load(
        b'{"num_running_reqs": 1, "num_waiting_reqs": 4, "token_usage": 0.1}'
    )
    assert (load.running, load.waiting, load.kv_usage) == (1, 4, 0.1)
    assert load.num_gpu_blocks is None


def test_sglang_garbage_is_an_error() -> None:
    with pytest.raises(ValueError):
        get_adapter("sglang").parse_load(b'{"loads": []}')
