"""Percentile, throughput, hit-rate, spread and client-lag maths against hand-computed cases."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.client import STATUS_TIMEOUT, RequestRecord
from bench.loadgen import LoadSpec, RunResult
from bench.stats import cache_hit_rate, load_spread, percentile, summarize


def rec(index: int, **kw: Any) -> RequestRecord:
    base: dict[str, Any] = {"index": index, "kind": "default", "priority": None, "group": None, "target": "t"}
    base.update(kw)
    return RequestRecord(**base)


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.sampled_from([0, 1, 50, 95, 99, 100]))
def test_percentile_matches_numpy_linear(values: list[float], q: int) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_cache_hit_rate_is_token_weighted_over_successes() -> None:
    records = [
        rec(0, status=200, prompt_tokens=1000, cached_tokens=900),
        rec(1, status=200, prompt_tokens=100, cached_tokens=0),
        rec(2, status=503, prompt_tokens=5000, cached_tokens=5000, error="x"),
    ]
    assert cache_hit_rate(records) == pytest.approx(900 / 1100)
    assert cache_hit_rate([rec(0, status=200)]) is None


def test_load_spread_is_max_over_mean() -> None:
    records = [rec(i, status=200, replica=r) for i, r in enumerate("aaab")]
    spread, counts = load_spread(records)
    assert counts == {"a": 3, "b": 1}
    assert spread == pytest.approx(3 / 2)


def test_summary_throughput_window_warmup_and_errors() -> None:
    records = [
        # warm-up: left out of everything
        rec(0, status=200, sent=0.0, ready=0.0, ttft=5.0, e2e=9.0, output_tokens=99, warmup=True),
        rec(1, status=200, sent=1.0, ready=1.0, ttft=0.1, e2e=1.0, itls=[0.01, 0.03], output_tokens=10,
            prompt_tokens=100, cached_tokens=50, replica="a", pool="p"),
        rec(2, status=200, sent=2.0, ready=2.0, ttft=0.3, e2e=2.0, itls=[0.02], output_tokens=30,
            prompt_tokens=100, cached_tokens=0, replica="b"),
        rec(3, status=429, sent=3.0, ready=3.0, e2e=0.01, error="busy", retry_after="1"),
        rec(4, status=STATUS_TIMEOUT, sent=3.5, ready=3.5, e2e=0.5, error="timed out"),
    ]  # fmt: skip
    result = RunResult(load=LoadSpec(rate=1.0), records=records, offered_rate=1.0, wall_s=9.0)
    s = summarize(result)
    assert s["requests"] == 4 and s["ok"] == 2 and s["warmup_requests"] == 1
    # window: first measured send (1.0) to last completion (2.0 + 2.0 = 4.0)
    assert s["window_s"] == pytest.approx(3.0)
    assert s["throughput_rps"] == pytest.approx(2 / 3.0)
    assert s["output_tokens_per_s"] == pytest.approx(40 / 3.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["p50"] == pytest.approx(20.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(1990.0)
    assert s["cache_hit_rate"] == pytest.approx(0.25)
    assert s["errors"] == {"429": 1, "timeout": 1}
    assert s["shed"] == {"count": 1, "with_retry_after": 1}  # the timeout was not shed
    assert s["replica_spread"] == pytest.approx(1.0)
    assert s["requests_per_pool"] == {"p": 1}
    assert s["offered_rps"] == 1.0
    assert s["sent_rps"] == pytest.approx(4 / 3.5)
    assert not s["client_limited"] and s["warnings"] == []


def test_client_lag_is_reported_loudly() -> None:
    records = [rec(i, status=200, scheduled=i * 0.1, ready=i * 0.1, sent=i * 0.1 + 0.2, ttft=0.01, e2e=0.02)
               for i in range(10)]  # fmt: skip
    result = RunResult(load=LoadSpec(rate=10.0), records=records, offered_rate=10.0, wall_s=2.0)
    s = summarize(result)
    assert s["client_limited"]
    assert any("CLIENT LAGGED" in w for w in s["warnings"])
    assert s["client_lag_p99_ms"] == pytest.approx(200.0)


def test_waiting_for_a_previous_turn_is_not_client_lag() -> None:
    # Turns ready late (their previous turn took 1 s) but sent at once: the server's doing.
    records = [rec(i, status=200, scheduled=i * 0.1, ready=i * 1.0, sent=i * 1.0, ttft=0.01, e2e=1.0)
               for i in range(10)]  # fmt: skip
    result = RunResult(load=LoadSpec(rate=10.0), records=records, offered_rate=10.0, wall_s=11.0)
    s = summarize(result)
    assert not s["client_limited"]
    assert any("waited for earlier turns" in w for w in s["warnings"])


def test_breakdown_by_priority_and_kind() -> None:
    records = [
        rec(0, status=200, priority="interactive", kind="interactive", ttft=0.01, e2e=0.1, sent=0.0),
        rec(1, status=200, priority="batch", kind="batch", ttft=1.0, e2e=2.0, sent=0.1),
        rec(2, status=429, priority="batch", kind="batch", sent=0.2, e2e=0.01, error="busy"),
    ]
    s = summarize(RunResult(load=LoadSpec(concurrency=2, mode="closed"), records=records,
                            offered_rate=None, wall_s=2.5))  # fmt: skip
    assert s["by_priority"]["batch"]["errors"] == {"429": 1}
    assert s["by_priority"]["interactive"]["ttft_ms"]["p50"] == pytest.approx(10.0)
    assert "by_kind" not in s  # the kinds are the priority classes: no second, identical table
    records[0].kind = records[1].kind = "short"
    assert set(
        summarize(RunResult(LoadSpec(mode="closed", concurrency=2), records, None, 2.5))["by_kind"]
    ) == {
        "short",
        "batch",
    }
