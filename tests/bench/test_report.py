"""Report files: ratios against the baseline, warnings up front, plots written."""

from __future__ import annotations

import json
from pathlib import Path

from bench.client import RequestRecord
from bench.loadgen import LoadSpec, RunResult
from bench.report import markdown, write_reports
from bench.scenario import RunPoint, point_from_result
from bench.stats import summarize


def run_point(config: str, rate: float, ttft: float, lag: float = 0.0) -> RunPoint:
    records = [
        RequestRecord(
            index=i,
            kind="default",
            priority="interactive" if i % 2 else "batch",
            group=None,
            target="t",
            status=200,
            scheduled=i * 0.1,
            ready=i * 0.1,
            sent=i * 0.1 + lag,
            ttft=ttft,
            e2e=ttft * 2,
            output_tokens=4,
            replica=f"r{i % 2}",
        )
        for i in range(10)
    ]
    result = RunResult(load=LoadSpec(rate=rate), records=records, offered_rate=rate, wall_s=2.0)
    return point_from_result(config, result, summarize(result))


def row(md: str, config: str, load: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {config} | {load} | 10/10"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_markdown_ratios_are_per_load_against_the_baseline() -> None:
    points = [
        run_point("base", 10, 0.100),
        run_point("base", 20, 0.200),
        run_point("new", 10, 0.050),
        run_point("new", 20, 0.300),
    ]
    md = markdown("t", points, "base", {"seed": 0})
    assert row(md, "new", "10 req/s")[16:18] == ["x0.50", "x0.50"]
    assert row(md, "new", "20 req/s")[16:18] == ["x1.50", "x1.50"]
    assert row(md, "base", "20 req/s")[16] == "x1.00"
    breakdown = [x for x in md.splitlines() if x.startswith("| new | 10 req/s | priority | interactive |")]
    assert breakdown and breakdown[0].rstrip(" |").endswith("x0.50 | x0.50")
    assert "WARNING" not in md


def test_client_lag_warning_heads_the_report_and_files_are_written(tmp_path: Path) -> None:
    points = [run_point("base", 10, 0.1), run_point("base", 20, 0.1, lag=0.3)]
    paths = write_reports(tmp_path, "t", points, "base", {"seed": 0})
    md = paths["markdown"].read_text()
    warning_at = md.index("**WARNING (base @ 20 req/s): CLIENT LAGGED ITS SCHEDULE")
    assert warning_at < md.index("| config |")
    doc = json.loads(paths["json"].read_text())
    assert [r["client_limited"] for r in doc["runs"]] == [False, True]
    assert paths["cdf"].stat().st_size > 1000
    assert paths["p95_vs_load"].stat().st_size > 1000


def test_kv_tiers_table_only_when_the_connector_loaded_tokens() -> None:
    from bench.engine_metrics import counter_delta

    points = [run_point("tiered", 10, 0.1), run_point("flat", 10, 0.2)]
    counters = {"prefix_cache_queries": 1000.0, "prefix_cache_hits": 300.0, "prompt_tokens": 1000.0}
    counters |= {"generation_tokens": 40.0, "preemptions": 0.0}
    points[0].summary["engine"] = counter_delta({}, counters | {"external_cache_hit_tokens": 500.0})
    points[1].summary["engine"] = counter_delta({}, counters | {"external_cache_hit_tokens": 0.0})
    md = markdown("t", points, "flat", {"seed": 0})
    assert "| tiered | 10 req/s | 100.0 | 100.0 | 100.0 | 300 | 500 | 200 |" in md  # 1000 - 300 - 500
    assert "| flat | 10 req/s | 200.0 | 200.0 | 200.0 | 300 | 0 | 700 |" in md
    points[0].summary["engine"]["external_cache_hit_tokens"] = 0.0
    assert "KV tiers" not in markdown("t", points, "flat", {"seed": 0})


def test_the_index_agrees_with_the_engines_within_ten_percent_per_medium() -> None:
    from bench.kv_agreement import agreement

    engines = {"prefix_cache_hits": 1000.0, "external_cache_hit_tokens": 400.0}
    got = agreement({"gpu": 1080.0, "cpu": 300.0}, engines)
    assert got["gpu"]["agrees"] and got["gpu"]["ratio"] == 1.08
    assert not got["cpu"]["agrees"] and got["cpu"]["ratio"] == 0.75  # a CPU tier believed smaller than it is
    # Nothing on a medium on either side: not compared; a CPU tier believed but never used: no agreement.
    assert set(agreement({"gpu": 1000.0}, {**engines, "external_cache_hit_tokens": 0.0})) == {"gpu"}
    assert (
        agreement({"gpu": 10.0, "cpu": 50.0}, {**engines, "external_cache_hit_tokens": 0.0})["cpu"]["agrees"]
        is False
    )
    # A policy that never looked at prefixes believed nothing: nothing to check.
    assert agreement({"gpu": 0.0, "cpu": 0.0}, engines) == {}
