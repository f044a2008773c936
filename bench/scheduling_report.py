"""Scheduling results: the client's view (report.json) joined with the gateway's (its JSON access log).

The client sees TTFT and status; only the gateway knows how long a request waited in its queue, so the
scheduling scenarios run the gateway with `server.log_json` and this reads `queue_ms` back per request.

    python -m bench.scheduling_report OUT_DIR [OUT_DIR ...] --results results/scheduling --name NAME

writes NAME.md (tables and the criteria of issue #7 with their verdicts) and NAME_*.png.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import result_files
from bench.scenario import _slug
from bench.stats import percentile
from gateway.config import SchedulerConfig

MIN_PROMPT_TOKENS = 100  # the harness's readiness probes are tiny; workload prompts are not
LONG_PROMPT_TOKENS = 1000  # the "long" requests of both scheduling workloads are above this
ANSWERS = {200, 429, 503}  # every request must end in one of these


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def gateway_requests(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in result_files.read_text(log).splitlines():
        if '"queue_ms"' not in line:
            continue
        doc = json.loads(line)
        if doc.get("prompt_tokens", 0) >= MIN_PROMPT_TOKENS:
            doc["length"] = "long" if doc["prompt_tokens"] >= LONG_PROMPT_TOKENS else "short"
            out.append(doc)
    return out


def load_runs(out_dir: Path) -> list[dict[str, Any]]:
    doc = json.loads(result_files.read_text(out_dir / "report.json"))
    runs = doc["runs"]
    for run in runs:
        log = out_dir / "logs" / f"{run['config']}-{_slug(run['load'])}-gateway.log"
        run["gateway"] = gateway_requests(log) if result_files.exists(log) else []
        cfg = yaml.safe_load((out_dir / "configs" / f"{run['config']}.yaml").read_text()) or {}
        run["aging_s"] = (cfg.get("scheduler") or {}).get("aging_s", SchedulerConfig().aging_s)
        run["records"] = [
            json.loads(line)
            for line in result_files.read_text(
                out_dir / "records" / f"{run['config']}-{_slug(run['load'])}.jsonl"
            ).splitlines()
        ]
    return runs


def steady_throughput(records: list[dict[str, Any]], skip_s: float = 10.0) -> float | None:
    """Completions per second between `skip_s` and the last send: a closed loop's saturation throughput
    without its ramp-up and its drain (the harness's req/s includes both)."""
    sent = [r["sent"] for r in records if r["sent"] is not None]
    if not sent or max(sent) <= skip_s:
        return None
    end = max(sent)
    done = [r["sent"] + r["e2e"] for r in records if r["status"] == 200 and r["e2e"] is not None]
    return sum(1 for t in done if skip_s <= t <= end) / (end - skip_s)


def criteria(runs: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, checked on these runs (only those the runs can answer)."""
    out = []
    unanswered = sum(
        1
        for run in runs
        for r in run["records"]
        if not r["warmup"] and (r["status"] not in ANSWERS or (r["status"] == 200 and r["error"]))
    )
    out.append(f"- requests without an answer (not 200/429/503, or a broken stream): {unanswered}")
    by_config: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_config.setdefault(run["config"], []).append(run)
    for config, group in by_config.items():
        p95 = [
            (run["offered_rps"], run["by_priority"]["interactive"]["ttft_ms"]["p95"])
            for run in group
            if run.get("offered_rps") and "interactive" in (run.get("by_priority") or {})
        ]
        if len(p95) >= 2:
            (lo_rate, lo), (hi_rate, hi) = min(p95), max(p95)
            verdict = "met" if hi <= 2 * lo else "MISSED"
            out.append(
                f"- {config}: interactive TTFT p95 {_f(hi)} ms at {hi_rate:g} req/s vs {_f(lo)} ms at "
                f"{lo_rate:g} req/s = x{hi / lo:.2f} (target <= x2: {verdict})"
            )
    fcfs = {run["load"]: run for run in runs if run["config"].startswith("fcfs")}
    for run in runs:
        base = fcfs.get(run["load"])
        if run["config"].startswith("sjf") and base is not None:
            cut = 1 - run["ttft_ms"]["mean"] / base["ttft_ms"]["mean"]
            out.append(
                f"- {run['config']} @ {run['load']}: mean TTFT {_f(run['ttft_ms']['mean'])} ms vs fcfs "
                f"{_f(base['ttft_ms']['mean'])} ms = {cut * 100:.0f}% lower "
                f"(target >= 30%: {'met' if cut >= 0.3 else 'MISSED'})"
            )
    for run in runs:
        longs = [r["queue_ms"] for r in run["gateway"] if r["replica"] and r["length"] == "long"]
        if longs and run.get("by_kind"):
            p99 = percentile(longs, 99) or 0.0
            out.append(
                f"- {run['config']} @ {run['load']}: long requests' queue wait p99 {_f(p99)} ms, max "
                f"{_f(max(longs))} ms; aging bound {run['aging_s']:g} s"
            )
    return out


def _groups(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return run.get("by_priority") or run.get("by_kind") or {}


def client_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| config | load | split | sent | ok | 429 | 503 | unanswered | TTFT mean | p50 | p95 | p99 |",
        "|" + " --- |" * 12,
    ]
    for run in runs:
        groups = {"all": run, **_groups(run)}
        for label, g in groups.items():
            recs = [r for r in run["records"] if label == "all" or label in (r["kind"], str(r["priority"]))]
            statuses = Counter(r["status"] for r in recs if not r["warmup"])
            unanswered = sum(n for s, n in statuses.items() if s not in ANSWERS)
            unanswered += sum(1 for r in recs if r["status"] == 200 and r["error"])
            t = g["ttft_ms"]
            lines.append(
                f"| {run['config']} | {run['load']} | {label} | {sum(statuses.values())} | {g['ok']} | "
                f"{statuses.get(429, 0)} | {statuses.get(503, 0)} | {unanswered} | {_f(t['mean'])} | "
                f"{_f(t['p50'])} | {_f(t['p95'])} | {_f(t['p99'])} |"
            )
    return lines


def queue_table(runs: list[dict[str, Any]], key: str) -> list[str]:
    lines = [
        f"| config | load | {key} | admitted | shed (reason:n) | queue wait p50 | p95 | p99 | max |",
        "|" + " --- |" * 9,
    ]
    for run in runs:
        for label in sorted({r[key] for r in run["gateway"]}):
            reqs = [r for r in run["gateway"] if r[key] == label]
            # Dispatched ones; a client that closes right after [DONE] can be logged 499, yet was served.
            waits = [r["queue_ms"] for r in reqs if r["replica"]]
            shed = Counter(r.get("shed") for r in reqs if r.get("shed"))
            lines.append(
                f"| {run['config']} | {run['load']} | {label} | {len(waits)} | "
                f"{', '.join(f'{k}:{v}' for k, v in sorted(shed.items())) or '0'} | "
                f"{_f(percentile(waits, 50))} | {_f(percentile(waits, 95))} | {_f(percentile(waits, 99))} | "
                f"{_f(max(waits, default=None))} |"
            )
    return lines


def cdf_plot(runs: list[dict[str, Any]], path: Path, title: str, values: str) -> None:
    """CDF per (config, load, group): client TTFT (`values="ttft"`) or gateway queue wait ("queue")."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for run in runs:
        if values == "ttft":
            series = {}
            for r in run["records"]:
                if r["status"] == 200 and r["ttft"] is not None and not r["warmup"]:
                    series.setdefault(str(r["priority"] if r["priority"] else r["kind"]), []).append(
                        r["ttft"] * 1000
                    )
        else:
            series = {}
            for r in run["gateway"]:
                if r["replica"]:
                    series.setdefault(r["length"], []).append(r["queue_ms"])
        for label, xs in sorted(series.items()):
            xs.sort()
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{run['config']} @ {run['load']}: {label}")  # fmt: skip
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("TTFT (ms)" if values == "ttft" else "gateway queue wait (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dirs", nargs="+", type=Path, help="bench scenario output directories")
    p.add_argument("--results", type=Path, default=Path("results/scheduling"))
    p.add_argument("--name", required=True, help="file name stem of the report")
    p.add_argument("--command", default="", help="the command that produced the runs, for the record")
    args = p.parse_args(argv)
    runs = []
    for d in args.out_dirs:
        for run in load_runs(d):
            if len(args.out_dirs) > 1:  # the same config may have run in several of them
                run["config"] = f"{run['config']} ({d.name})"
            runs.append(run)
    metas = [json.loads(result_files.read_text(d / "report.json"))["meta"] for d in args.out_dirs]
    args.results.mkdir(parents=True, exist_ok=True)
    lines = [f"# Scheduling: {args.name}", ""]
    if args.command:
        lines += ["```", args.command, "```", ""]
    for meta in metas:
        lines += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    lines += ["## Client view (TTFT in ms, wall clock)", "", *client_table(runs), ""]
    for run in runs:
        if run["load"].startswith("C="):
            rate = steady_throughput(run["records"])
            lines.append(
                f"- capacity, {run['config']} @ {run['load']}: {_f(rate, 2)} completions/s (steady state)"
            )
    lines += ["Unanswered = anything but 200/429/503 (timeouts, connection errors, broken streams).", ""]
    lines += ["## Criteria (issue #7)", "", *criteria(runs), ""]
    key = "priority" if any(r.get("by_priority") for r in runs) else "length"
    lines += ["## Gateway view (queue wait in ms, from the access log)", "", *queue_table(runs, key), ""]
    ttft_png = args.results / f"{args.name}_ttft_cdf.png"
    queue_png = args.results / f"{args.name}_queue_wait_cdf.png"
    cdf_plot(runs, ttft_png, f"{args.name}: TTFT", "ttft")
    cdf_plot(runs, queue_png, f"{args.name}: gateway queue wait", "queue")
    lines += [f"![TTFT CDF]({ttft_png.name})", "", f"![queue wait CDF]({queue_png.name})", ""]
    (args.results / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
