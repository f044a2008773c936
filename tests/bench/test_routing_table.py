"""bench.routing_table: ratios to radix_cache_aware within each run, and their spread over seeds."""

from __future__ import annotations

import json
from pathlib import Path

from bench.routing_table import seeds_table, table


def _report(path: Path, pa: tuple[float, float], radix: tuple[float, float]) -> Path:
    def run(config: str, mean: float, p99: float) -> dict[str, object]:
        return {
            "config": config,
            "load": "16 req/s",
            "ok": 10,
            "requests": 10,
            "ttft_ms": {"mean": mean, "p50": mean, "p99": p99},
            "cache_hit_rate": 0.9,
            "throughput_rps": 16.0,
        }

    path.mkdir()
    runs = [run("prefix_affinity", *pa), run("radix_cache_aware", *radix)]
    (path / "report.json").write_text(json.dumps({"meta": {"scenario": "routing-x (full)"}, "runs": runs}))
    return path


def test_seeds_are_summarized_as_ratios_within_each_run(tmp_path: Path) -> None:
    dirs = [
        _report(tmp_path / "s1", (90.0, 300.0), (100.0, 200.0)),
        _report(tmp_path / "s2", (110.0, 100.0), (100.0, 200.0)),
    ]
    lines = seeds_table(dirs).splitlines()
    pa = next(line for line in lines if "| prefix_affinity |" in line)
    assert "| 2 | 1.00 (0.90-1.10) | 1.00 (0.50-1.50) | 100.0 | 90.0% |" in pa
    assert "| 1.00 | 1.00 |" in next(line for line in table(dirs).splitlines() if "radix_cache_aware" in line)
