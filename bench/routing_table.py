"""One table of routing results across scenarios: mean, p50 and p99 TTFT, cache hit rate, and the
ratios that issue 18 sets targets on (against radix_cache_aware's TTFT and the oracle's hit rate).

    python -m bench.routing_table bench/out/routing-hetero bench/out/routing-bursty ... [--out FILE]

Each argument is a scenario's output directory (its report.json); every run in it becomes a row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
    body = [row for d in dirs for row in rows(json.loads((d / "report.json").read_text()))]
    return "\n".join(head + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing_table", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = table(args.dirs)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
