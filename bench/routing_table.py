"""One table of routing results across scenarios: mean, p50 and p99 TTFT, cache hit rate, and the
ratios that issue 18 sets targets on (against radix_cache_aware's TTFT and the oracle's hit rate).

    python -m bench.routing_table results/out/routing-hetero results/out/routing-bursty ... [--out FILE]
    python -m bench.routing_table --seeds results/out/hetero-seed1 results/out/hetero-seed2 ...

Each argument is a scenario's output directory (its report.json); every run in it becomes a row.
With `--seeds`, the runs of one scenario and configuration over several directories (the same
scenario run with different `--seed`s) become one row: each ratio to radix_cache_aware taken
within its own run, then their mean and range over the seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import result_files

REFERENCE = "radix_cache_aware"
ORACLE = "oracle"


def rows(report: dict[str, Any]) -> list[str]:
    runs = report["runs"]
    scenario = report["meta"]["scenario"].split(":")[0]
    by_config = {r["config"]: r for r in runs}
    ref = by_config.get(REFERENCE)
    oracle = by_config.get(ORACLE)
    out = []
    for r in runs:
        t = r["ttft_ms"]
        cells = [scenario, r["config"], r["load"], f"{r['ok']}/{r['requests']}"]
        cells += [f"{t['mean']:.1f}", f"{t['p50']:.1f}", f"{t['p99']:.1f}", f"{r['cache_hit_rate']:.1%}"]
        if ref is not None:
            rt = ref["ttft_ms"]
            cells += [f"{t['mean'] / rt['mean']:.2f}", f"{t['p99'] / rt['p99']:.2f}"]
        else:
            cells += ["-", "-"]
        if oracle is not None and oracle["cache_hit_rate"]:
            cells.append(f"{r['cache_hit_rate'] / oracle['cache_hit_rate']:.1%}")
        else:
            cells.append("-")
        cells.append(f"{r['throughput_rps']:.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def table(dirs: list[Path]) -> str:
    head = [
        "| scenario | config | load | ok | TTFT mean | p50 | p99 (ms) | hit rate | mean / radix "
        "| p99 / radix | hit / oracle | req/s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    body = [row for d in dirs for row in rows(json.loads(result_files.read_text(d / "report.json")))]
    return "\n".join(head + body) + "\n"


def seeds_table(dirs: list[Path]) -> str:
    ratios: dict[tuple[str, str, str], list[tuple[float, float, float, float]]] = {}
    for d in dirs:
        report = json.loads(result_files.read_text(d / "report.json"))
        by_config = {r["config"]: r for r in report["runs"]}
        ref = by_config.get(REFERENCE)
        if ref is None:
            continue
        scenario = report["meta"]["scenario"].split(":")[0]
        for config, r in by_config.items():
            t, rt = r["ttft_ms"], ref["ttft_ms"]
            ratios.setdefault((scenario, config, str(r["load"])), []).append(
                (t["mean"] / rt["mean"], t["p99"] / rt["p99"], t["mean"], r["cache_hit_rate"])
            )
    lines = [
        "| scenario | config | load | seeds | mean / radix: mean (range) | p99 / radix: mean (range) "
        "| TTFT mean ms (mean of seeds) | hit rate |",
        "| --- | --- | --- | ---: | --- | --- | ---: | ---: |",
    ]
    for (scenario, config, load), got in ratios.items():
        means, p99s, ttft, hits = zip(*got, strict=True)
        lines.append(
            f"| {scenario} | {config} | {load} | {len(got)} "
            f"| {sum(means) / len(got):.2f} ({min(means):.2f}-{max(means):.2f}) "
            f"| {sum(p99s) / len(got):.2f} ({min(p99s):.2f}-{max(p99s):.2f}) "
            f"| {sum(ttft) / len(got):.1f} | {sum(hits) / len(got):.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing_table", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument(
        "--seeds", action="store_true", help="one row per scenario and config over the directories' seeds"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = seeds_table(args.dirs) if args.seeds else table(args.dirs)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
