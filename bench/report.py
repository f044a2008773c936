"""Report files of a benchmark: report.json, report.md (tables with ratios), PNG plots.

The Markdown table has one row per (configuration, load point); ratio columns compare each row
with the baseline configuration at the same load point (x0.50 = half the baseline's value).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import kv_agreement
from bench.scenario import RunPoint

MAIN_COLUMNS = (
    "config", "load", "ok/sent", "TTFT p50", "p95", "p99", "ITL p50", "p95", "e2e p50", "p95", "req/s",
    "out tok/s", "offered / sent rps", "cache hit", "spread", "errors",
    "TTFT p50 ratio", "TTFT p95 ratio", "req/s ratio",
)  # fmt: skip
BREAKDOWN_COLUMNS = (
    "config", "load", "split", "class", "ok/sent", "TTFT p50", "p95", "p99", "ITL p95", "e2e p95",
    "cache hit", "errors",
    "TTFT p50 ratio", "TTFT p95 ratio",
)  # fmt: skip


def _header(columns: Sequence[str]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(v: float | None, base: float | None) -> str:
    if v is None or not base:
        return "-"
    return f"x{v / base:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _errors(summary: dict[str, Any]) -> str:
    errs = summary["errors"]
    return ", ".join(f"{k}:{v}" for k, v in sorted(errs.items())) or "0"


def markdown(title: str, points: Sequence[RunPoint], baseline: str, meta: dict[str, Any]) -> str:
    base = {p.load: p.summary for p in points if p.config == baseline}
    lines = [f"# {title}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", f"Ratios are relative to `{baseline}` at the same load. Latencies in ms (wall clock)."]
    warned = [(p, w) for p in points for w in p.summary["warnings"]]
    if warned:
        lines += [""] + [f"> **WARNING ({p.config} @ {p.load}): {w}**" for p, w in warned]
    lines += [
        "",
        *_header(MAIN_COLUMNS),
    ]
    for p in points:
        s = p.summary
        b = base.get(p.load, {})
        lines.append(
            "| "
            + " | ".join(
                [
                    p.config,
                    p.load,
                    f"{s['ok']}/{s['requests']}",
                    _f(s["ttft_ms"]["p50"]),
                    _f(s["ttft_ms"]["p95"]),
                    _f(s["ttft_ms"]["p99"]),
                    _f(s["itl_ms"]["p50"], 2),
                    _f(s["itl_ms"]["p95"], 2),
                    _f(s["e2e_ms"]["p50"]),
                    _f(s["e2e_ms"]["p95"]),
                    _f(s["throughput_rps"], 2),
                    _f(s["output_tokens_per_s"], 0),
                    f"{_f(s['offered_rps'], 2)} / {_f(s['sent_rps'], 2)}",
                    _pct(s["cache_hit_rate"]),
                    _f(s["replica_spread"], 2),
                    _errors(s),
                    _ratio(s["ttft_ms"]["p50"], (b.get("ttft_ms") or {}).get("p50")),
                    _ratio(s["ttft_ms"]["p95"], (b.get("ttft_ms") or {}).get("p95")),
                    _ratio(s["throughput_rps"], b.get("throughput_rps")),
                ]
            )
            + " |"
        )
    breakdown = [
        (p, key, groups)
        for p in points
        for key in ("by_priority", "by_kind")
        if (groups := p.summary.get(key))
    ]
    if breakdown:
        lines += [
            "",
            "## Breakdown by class",
            "",
            *_header(BREAKDOWN_COLUMNS),
        ]
        for p, key, groups in breakdown:
            for label, g in groups.items():
                b = ((base.get(p.load) or {}).get(key) or {}).get(label) or {}
                b_ttft = b.get("ttft_ms") or {}
                lines.append(
                    f"| {p.config} | {p.load} | {key[3:]} | {label} | {g['ok']}/{g['requests']} | "
                    f"{_f(g['ttft_ms']['p50'])} | {_f(g['ttft_ms']['p95'])} | {_f(g['ttft_ms']['p99'])} | "
                    f"{_f(g['itl_ms']['p95'])} | {_f(g['e2e_ms']['p95'])} | "
                    f"{_pct(g['cache_hit_rate'])} | {_errors(g)} | "
                    f"{_ratio(g['ttft_ms']['p50'], b_ttft.get('p50'))} | "
                    f"{_ratio(g['ttft_ms']['p95'], b_ttft.get('p95'))} |"
                )
    lines += ["", "Requests per replica:", ""]
    lines += [f"- {p.config} @ {p.load}: {p.summary['requests_per_replica']}" for p in points]
    engines = [(p, e) for p in points if (e := p.summary.get("engine"))]
    if engines:
        lines += ["", "Engines' own counters (summed over the fleet, priming requests included):", ""]
        lines += [
            f"- {p.config} @ {p.load}: prefix-cache hit {_pct(e['prefix_cache_hit_rate'])}, "
            f"preemptions {e['preemptions']:.0f}, prompt tokens {e['prompt_tokens']:.0f}, "
            f"generated {e['generation_tokens']:.0f}"
            + (
                f", KV loaded from other replicas {e['external_cache_hit_tokens']:.0f} tokens"
                f" in {e.get('kv_transfers', 0):.0f} transfers"
                f" ({e.get('kv_transfer_bytes', 0) / 2**20:.0f} MiB,"
                f" {e.get('kv_transfers_failed', 0):.0f} failed)"
                if e.get("kv_transfers")
                else ""
            )
            + (f", PD hand-offs {p.summary['pd']}" if p.summary.get("pd") else "")
            + (
                f", LoRA swaps {e['lora_swaps']:.0f} ({e['lora_swaps_per_min']:.0f}/min), "
                f"disk loads {e['lora_disk_loads']:.0f} ({e['lora_disk_loads_per_min']:.0f}/min)"
                if "lora_swaps_per_min" in e
                else ""
            )
            for p, e in engines
        ]
    lines += tier_table(points)
    lines += agreement_table(points)
    return "\n".join(lines) + "\n"


def agreement_table(points: Sequence[RunPoint]) -> list[str]:
    """kvgate's index against the engines' counters, per medium (bench.kv_agreement)."""
    runs = [(p, a) for p in points if (a := p.summary.get("kv_agreement"))]
    if not runs:
        return []
    lines = ["", "kvgate's index against the engines (tokens believed held / tokens the engines found; "
             f"agrees within {kv_agreement.TOLERANCE:.0%}):", ""]  # fmt: skip
    lines += _header(["config", "load", "medium", "kvgate", "engines", "ratio", "agrees"])
    for p, a in runs:
        for medium, row in a.items():
            lines.append(
                f"| {p.config} | {p.load} | {medium} | {row['kvgate_tokens']:.0f} | "
                f"{row['engine_tokens']:.0f} | {_f(row['ratio'], 3)} | {'yes' if row['agrees'] else 'NO'} |"
            )
    return lines


def tier_table(points: Sequence[RunPoint]) -> list[str]:
    """Where prompt tokens came from, per run, when the engines' KV connector loaded some from the
    CPU tier of engines with --kv-offloading-size."""
    key = "external_cache_hit_tokens"
    # A PD decode leg's loads are transfers from another replica, not a tier: reported beside them.
    runs = [
        (p, e) for p in points if key in (e := p.summary.get("engine") or {}) and not e.get("kv_transfers")
    ]
    if not any(e[key] for _, e in runs):
        return []
    lines = ["", "KV tiers (engines' counters; tokens, priming requests included):", ""]
    columns = ["config", "load", "TTFT p50", "TTFT mean", "TTFT p99", "GPU hits", "CPU hits", "recomputed"]
    lines += _header(columns)
    for p, e in runs:
        t = p.summary["ttft_ms"]
        lines.append(
            f"| {p.config} | {p.load} | {_f(t['p50'])} | {_f(t['mean'])} | {_f(t['p99'])} | "
            f"{e['prefix_cache_hits']:.0f} | {e[key]:.0f} | {e['recomputed_tokens']:.0f} |"
        )
    return lines


def summary_table(points: Sequence[RunPoint], baseline: str) -> str:
    """The comparison that matters at a glance, with aligned columns, for the terminal."""
    base = {p.load: p.summary for p in points if p.config == baseline}
    header = ["config", "load", "ok/sent", "TTFT p50", "TTFT p95", "vs base p50/p95", "ITL p50", "cache hit",
              "req/s", "vs base", "spread", "errors"]  # fmt: skip
    lora = any("lora_swaps_per_min" in (p.summary.get("engine") or {}) for p in points)
    if lora:
        header += ["LoRA swaps/min", "disk loads/min"]
    rows = [header]
    for p in points:
        s, b = p.summary, base.get(p.load, {})
        b_ttft = b.get("ttft_ms") or {}
        vs_p50 = _ratio(s["ttft_ms"]["p50"], b_ttft.get("p50"))
        vs_p95 = _ratio(s["ttft_ms"]["p95"], b_ttft.get("p95"))
        rows.append(
            [
                p.config,
                p.load,
                f"{s['ok']}/{s['requests']}",
                _f(s["ttft_ms"]["p50"]),
                _f(s["ttft_ms"]["p95"]),
                f"{vs_p50} / {vs_p95}",
                _f(s["itl_ms"]["p50"], 2),
                _pct(s["cache_hit_rate"]),
                _f(s["throughput_rps"], 2),
                _ratio(s["throughput_rps"], b.get("throughput_rps")),
                _f(s["replica_spread"], 2),
                _errors(s),
            ]
        )
        if lora:
            e = s.get("engine") or {}
            rows[-1] += [_f(e.get("lora_swaps_per_min"), 0), _f(e.get("lora_disk_loads_per_min"), 0)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    warned = [f"WARNING ({p.config} @ {p.load}): {w}" for p in points for w in p.summary["warnings"]]
    return "\n".join([*lines, *warned]) + "\n"


def ttft_cdf_plot(points: Sequence[RunPoint], path: Path) -> None:
    loads = list(dict.fromkeys(p.load for p in points))
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4.5), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for p in points:
            if p.load != load:
                continue
            ttfts = sorted(p.ttft_ms)
            if ttfts:
                ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                ax.step(ttfts, ys, where="post", label=p.config)
        ttft_all = [t for p in points if p.load == load for t in p.ttft_ms if t > 0]
        if ttft_all and max(ttft_all) > 20 * min(ttft_all):
            ax.set_xscale("log")  # warm hits and cold prefills lie orders of magnitude apart
        ax.set_title(f"TTFT CDF @ {load}")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def p95_vs_load_plot(points: Sequence[RunPoint], path: Path) -> bool:
    """TTFT p95 against offered load, one line per config; only when several loads ran."""
    if len({p.load for p in points}) < 2:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for config in dict.fromkeys(p.config for p in points):
        pts = sorted(
            (p.offered_rps or p.summary["sent_rps"] or 0.0, p.summary["ttft_ms"]["p95"])
            for p in points
            if p.config == config and p.summary["ttft_ms"]["p95"] is not None
        )
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=config)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("TTFT p95 (ms)")
    ax.set_title("TTFT p95 vs offered load")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_reports(
    out_dir: Path,
    title: str,
    points: Sequence[RunPoint],
    baseline: str,
    meta: dict[str, Any],
) -> dict[str, Path]:
    """Write report.json, report.md and the plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "markdown": out_dir / "report.md",
        "cdf": out_dir / "ttft_cdf.png",
    }
    doc = {
        "title": title,
        "baseline": baseline,
        "meta": meta,
        "runs": [{"config": p.config, "load": p.load, **p.summary} for p in points],
    }
    paths["json"].write_text(json.dumps(doc, indent=2))
    paths["markdown"].write_text(markdown(title, points, baseline, meta))
    ttft_cdf_plot(points, paths["cdf"])
    p95_path = out_dir / "ttft_p95_vs_load.png"
    if p95_vs_load_plot(points, p95_path):
        paths["p95_vs_load"] = p95_path
    return paths
