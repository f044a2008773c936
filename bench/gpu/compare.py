"""Tables of the H200 run, with the simulator's figures for the same scenarios beside them.

python -m bench.gpu.compare KG [--sim SIM_RES [--run-sim]] [--out FILE]

KG is the run's folder (kg/ of the returned kg.tar.gz): steps.jsonl names every scenario step, the
arguments it ran with and where its report is (KG/res/<out>/report.json). SIM_RES holds the
simulator's reports of the same steps (SIM_RES/<out>/report.json); `--run-sim` first runs every
step that has none yet, here, on the scenario's own simulated fleet with the same arguments (the
h200 sizes give the simulator the engines' KV bytes and dtype, and four replicas time-sharing one
simulated H200 as the engines share the real one, `--gpu-share 4`, at speedup 1). The output is Markdown:
start-up and calibration, one table per scenario (H200 beside the simulator, with the simulator's
ratio to the H200), the issue's targets with their verdicts, the kill test and the FP8/BF16 pair.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import result_files

SIM_TOLERANCE = 0.15
TITLES = {
    "probe": "Capacity probes (completions/s served over the whole overload run)",
    "routing": "Routing: shared-prefix groups at 90% of round-robin's sustainable rate (FP8 KV)",
    "scheduling_overload": "Scheduling: interactive + batch at 50% and 150% of capacity",
    "scheduling_sjf": "Scheduling: FCFS vs SJF at 90% of capacity",
    "mooncake": "Multi-turn: Mooncake conversation trace",
    "routing-hot": "Hot prefix: two hot prefixes over four replicas",
    "bf16-routing": "BF16 KV cache, same memory, same workload and rate as the FP8 routing table",
    "routing-hot-device": "Hot prefix with the four replicas known as one GPU (device_load on and off)",
    "routing-tiers-gpu": "CPU KV tiers: the prefix working set within the CPU tiers, 2.8x the GPUs' KV",
    "canonicalize-gpu": "Canonicalization: a per-request line (time, session id) ahead of the system prompt",
}
# Groups whose table also has the engines' own counters (summed over the fleet, this run's share).
ENGINE_GROUPS = ("routing-tiers-gpu", "canonicalize-gpu")
FAULT_GROUPS = ("failover-vllm",)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(result_files.read_text(path))
    except (OSError, ValueError):
        return None


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(sim: float | None, gpu: float | None) -> str:
    if sim is None or not gpu:
        return "-"
    r = sim / gpu
    return f"{r:.2f}{' !!' if abs(r - 1) > SIM_TOLERANCE else ''}"


def steps(kg: Path) -> list[dict[str, Any]]:
    path = kg / "steps.jsonl"
    if not result_files.exists(path):
        return []
    return [json.loads(line) for line in result_files.read_text(path).splitlines() if line.strip()]


def runs(report_dir: Path) -> list[dict[str, Any]]:
    doc = _load(report_dir / "report.json")
    return doc["runs"] if doc else []


def _row(run: dict[str, Any], sim: dict[str, Any] | None) -> str:
    t = run["ttft_ms"]
    cells = [
        run["config"],
        run["load"],
        _f(t["p50"]),
        _f(t["p95"]),
        _f(t["mean"]),
        _f(run["cache_hit_rate"], 3),
        _f(run.get("throughput_rps"), 2),
        ", ".join(f"{k}: {v}" for k, v in run["errors"].items()) or "0",
    ]
    if sim is not None:
        s = sim["ttft_ms"]
        cells += [
            _f(s["p50"]),
            _f(s["p95"]),
            _f(sim["cache_hit_rate"], 3),
            _ratio(s["p50"], t["p50"]),
            _ratio(s["p95"], t["p95"]),
            _ratio(sim["cache_hit_rate"], run["cache_hit_rate"]),
        ]
    return "| " + " | ".join(cells) + " |"


def _engine_row(run: dict[str, Any], sim: dict[str, Any] | None) -> str:
    """TTFT p50/mean/p99 and the engines' counters: GPU hits, CPU (connector) hits, recomputed prompt
    tokens and CPU loads, the simulator's beside each."""

    def cells(r: dict[str, Any] | None) -> list[str]:
        if r is None:
            return ["-"] * 8
        t, e = r["ttft_ms"], r.get("engine") or {}
        return [
            _f(t["p50"]),
            _f(t["mean"]),
            _f(t["p99"]),
            _f(r["cache_hit_rate"], 3),
            _f(e.get("prefix_cache_hits"), 0),
            _f(e.get("external_cache_hit_tokens"), 0),
            _f(e.get("recomputed_tokens"), 0),
            _f(e.get("cpu_loads"), 0),
        ]

    ratio = _ratio(sim["ttft_ms"]["mean"], run["ttft_ms"]["mean"]) if sim else "-"
    return "| " + " | ".join([run["config"], *cells(run), *cells(sim), ratio]) + " |"


def engine_table(rows: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> list[str]:
    cols = "TTFT p50 | mean | p99 (ms) | hit | GPU hit tokens | CPU hit tokens | recomputed | CPU loads"
    head = f"| config | {cols} | sim: {cols} | sim/GPU mean |"
    return [head, "|" + "---|" * (head.count("|") - 1), *(_engine_row(r, s) for r, s in rows)]


def fault_tables(kg: Path, sim_root: Path | None) -> list[str]:
    """failover-vllm's variants (bench/faults.py reports, one folder per variant), the simulator's beside."""
    keys = ("sent", "completed", "error", "lost")
    fkeys = (
        "cut",
        "resumed",
        "token_identical",
        "control_identical",
        "seam_added_ms_p50",
        "seam_added_ms_p99",
    )
    lines: list[str] = []
    for group in FAULT_GROUPS:
        variants = sorted(p.parent.name for p in (kg / "res" / group).glob("*/report.json"))
        if not variants:
            continue
        head = "| variant | side | " + " | ".join(keys + fkeys) + " |"
        lines += [f"### Mid-stream failover: {group}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for v in variants:
            sides = [("GPU", kg / "res" / group / v), ("sim", sim_root / group / v if sim_root else None)]
            for side, folder in sides:
                doc = _load(folder / "report.json") if folder else None
                if doc is None:
                    continue
                fo = doc.get("failover") or {}
                got = [fo.get(k) for k in fkeys]
                vals = [str(doc.get(k, "-")) for k in keys] + [
                    _f(v, 0) if isinstance(v, float) else ("-" if v is None else str(v)) for v in got
                ]
                lines.append(f"| {v} | {side} | " + " | ".join(vals) + " |")
        lines.append("")
    return lines


def scenario_tables(
    kg: Path, sim_root: Path | None
) -> tuple[list[str], dict[str, dict[str, dict[str, Any]]]]:
    """One table per scenario group; also returns every run by group and config for the verdicts."""
    by_group: dict[str, list[tuple[dict[str, Any], dict[str, Any] | None]]] = {}
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for step in steps(kg):
        group = step["out"].split("/")[0]
        if group in FAULT_GROUPS:
            continue
        sim_runs = {(r["config"], r["load"]): r for r in runs(sim_root / step["out"])} if sim_root else {}
        for run in runs(kg / "res" / step["out"]):
            by_group.setdefault(group, []).append((run, sim_runs.get((run["config"], run["load"]))))
            found.setdefault(group, {})[f"{run['config']}@{run['load']}"] = run
    lines: list[str] = []
    head = "| config | load | TTFT p50 | p95 | mean (ms) | hit rate | req/s | errors |"
    if sim_root:
        head += " sim p50 | sim p95 | sim hit | sim/GPU p50 | p95 | hit |"
    for group, rows in by_group.items():
        lines += [f"### {TITLES.get(group, group)}", "", head, "|" + "---|" * (head.count("|") - 1)]
        lines += [_row(run, sim) for run, sim in rows]
        lines.append("")
        if group in ENGINE_GROUPS:
            lines += ["The engines' own counters:", "", *engine_table(rows), ""]
    return lines + fault_tables(kg, sim_root), found


def _first(runs_by_key: dict[str, dict[str, Any]], config: str) -> dict[str, Any] | None:
    return next((r for k, r in runs_by_key.items() if k.split("@")[0] == config), None)


def _check(label: str, ok: bool | None, detail: str) -> str:
    verdict = "n/a" if ok is None else ("met" if ok else "NOT met")
    return f"| {label} | {detail} | {verdict} |"


def verdicts(found: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    out = ["| target | figures | verdict |", "|---|---|---|"]
    routing = found.get("routing", {})
    rr, oracle = _first(routing, "round_robin"), _first(routing, "oracle")
    for name in ("prefix_affinity_default", "prefix_affinity_precise"):
        pa = _first(routing, name)
        if not (pa and oracle):
            continue
        hit = pa["cache_hit_rate"] / oracle["cache_hit_rate"] if oracle["cache_hit_rate"] else None
        out.append(_check(f"{name} hit >= 0.97 x oracle", hit is not None and hit >= 0.97, f"{_f(hit, 3)}"))
        for stat in ("p50", "mean"):
            r = pa["ttft_ms"][stat] / oracle["ttft_ms"][stat] if oracle["ttft_ms"][stat] else None
            out.append(_check(f"{name} TTFT {stat} <= 1.1 x oracle", r is not None and r <= 1.1, _f(r, 2)))
        if rr:
            r = pa["ttft_ms"]["p50"] / rr["ttft_ms"]["p50"] if rr["ttft_ms"]["p50"] else None
            out.append(
                _check(f"{name} TTFT p50 <= 0.35 x round_robin", r is not None and r <= 0.35, _f(r, 2))
            )
    sched = list(found.get("scheduling_overload", {}).values())
    if len(sched) >= 2:
        lo, hi = sorted(sched, key=lambda r: r.get("offered_rps") or 0)[:: len(sched) - 1]
        p95 = [
            ((r.get("by_priority") or {}).get("interactive") or {}).get("ttft_ms", {}).get("p95")
            for r in (lo, hi)
        ]
        ok = None if None in p95 else p95[1] <= 2 * p95[0]
        out.append(
            _check("interactive TTFT p95 at 150% <= 2 x at 50%", ok, f"{_f(p95[1])} vs {_f(p95[0])} ms")
        )
        shed = hi.get("shed") or {"count": 0, "with_retry_after": 0}
        other = {k: v for k, v in hi["errors"].items() if k not in ("429", "503")}
        ok = not other and shed["count"] == shed["with_retry_after"]
        detail = (
            f"{shed['count']} shed, {shed['with_retry_after']} with Retry-After; other errors {other or 0}"
        )
        out.append(_check("every shed request 429/503 with Retry-After", ok, detail))
    sjf = found.get("scheduling_sjf", {})
    fcfs, short = _first(sjf, "fcfs"), _first(sjf, "sjf")
    if fcfs and short:
        r = short["ttft_ms"]["mean"] / fcfs["ttft_ms"]["mean"] if fcfs["ttft_ms"]["mean"] else None
        out.append(_check("SJF mean TTFT below FCFS's", r is not None and r < 1, f"sjf/fcfs {_f(r, 2)}"))
    tiers = found.get("routing-tiers-gpu", {})
    ignored = _first(tiers, "tier_ignored")
    peers = [r for r in (_first(tiers, n) for n in ("radix_cache_aware", "sglang_router", "smg")) if r]
    for name in ("tier_precise", "tier_approx"):
        aware = _first(tiers, name)
        if not (aware and ignored):
            continue
        r = aware["ttft_ms"]["mean"] / ignored["ttft_ms"]["mean"] if ignored["ttft_ms"]["mean"] else None
        out.append(_check(f"{name} mean TTFT <= 0.8 x tier_ignored", r is not None and r <= 0.8, _f(r, 2)))
        if peers:
            best = min(p["ttft_ms"]["mean"] for p in peers)
            r = aware["ttft_ms"]["mean"] / best if best else None
            out.append(
                _check(f"{name} mean TTFT <= 1.0 x the best peer", r is not None and r <= 1.0, _f(r, 2))
            )
        for medium, row in (aware.get("kv_agreement") or {}).items():
            out.append(
                _check(
                    f"{name}: kvgate's {medium} tokens within 10% of the engines'",
                    row["agrees"],
                    f"{row['kvgate_tokens']:.0f} / {row['engine_tokens']:.0f} = {_f(row['ratio'], 3)}",
                )
            )
        e = aware.get("engine") or {}
        cached = (e.get("prefix_cache_hits") or 0) + (e.get("external_cache_hit_tokens") or 0)
        share = (e.get("external_cache_hit_tokens") or 0) / cached if cached else None
        out.append(
            _check(
                f"{name}: CPU hits a visible share of cached tokens (>= 10%)",
                share is not None and share >= 0.1,
                _f(share, 3),
            )
        )
    for group in ("mooncake", "routing-hot"):
        runs_ = found.get(group, {})
        pa = _first(runs_, "prefix_affinity") or _first(runs_, "prefix_affinity_default")
        radix = _first(runs_, "radix_cache_aware")
        if pa and radix:
            r = pa["ttft_ms"]["mean"] / radix["ttft_ms"]["mean"] if radix["ttft_ms"]["mean"] else None
            hits = f"hit {_f(pa['cache_hit_rate'], 3)} vs {_f(radix['cache_hit_rate'], 3)}"
            out.append(
                _check(
                    f"{group}: prefix_affinity mean TTFT vs radix_cache_aware", None, f"{_f(r, 2)}, {hits}"
                )
            )
    return out if len(out) > 2 else []


def dtype_section(kg: Path, found: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The same routing runs on the FP8 and on the BF16 KV cache (the same bytes of KV per replica)."""
    bf16 = found.get("bf16-routing", {})
    if not bf16:
        return []
    kv = {}
    for tag, name in (("fp8", "calib.json"), ("bf16", "calib_bf16.json")):
        calib = _load(kg / name) or {}
        tokens = [v["kv_tokens"] for v in calib.get("kv_capacity", {}).values() if v.get("kv_tokens")]
        kv[tag] = min(tokens) if tokens else None
    rows = [
        f"KV tokens per replica: FP8 {kv['fp8']}, BF16 {kv['bf16']}",
        "",
        "| config | FP8 TTFT p50 / mean (ms) | BF16 TTFT p50 / mean (ms) | FP8 hit | BF16 hit | BF16 req/s |",
        "|---|---|---|---|---|---|",
    ]
    for key, run in bf16.items():
        fp8 = found.get("routing", {}).get(key)
        f = fp8["ttft_ms"] if fp8 else {"p50": None, "mean": None}
        b = run["ttft_ms"]
        rows.append(
            f"| {run['config']} | {_f(f['p50'])} / {_f(f['mean'])} | {_f(b['p50'])} / {_f(b['mean'])} | "
            f"{_f(fp8['cache_hit_rate'] if fp8 else None, 3)} | {_f(run['cache_hit_rate'], 3)} | "
            f"{_f(run.get('throughput_rps'), 2)} |"
        )
    return rows


def _section(title: str, body: list[str]) -> list[str]:
    return [f"## {title}", "", *body, ""] if body else []


def fleet_section(kg: Path) -> list[str]:
    lines = []
    for tag in ("fp8", "bf16", "tiers", "pd"):
        doc = _load(kg / f"fleet_{tag}.json")
        calib = _load(kg / ("calib.json" if tag == "fp8" else f"calib_{tag}.json"))
        if doc:
            lines.append(
                f"- {tag}: every replica routed by the gateway {doc.get('all_ready_s', '-')} s after the "
                f"start; engines healthy at {doc['engine_ready_s']} s, "
                f"in the pool at {doc['gateway_ready_s']} s"
            )
        if calib:
            kv = {k: v["kv_tokens"] for k, v in calib.get("kv_capacity", {}).items()}
            lines.append(f"  KV tokens per replica {kv}; tokenizer {calib.get('tokenizer')}")
            ev = calib.get("kv_events", {})
            reset = calib.get("prefix_cache_reset")
            lines.append(f"  KV events {ev.get('messages_per_publisher')}; cache reset {reset}")
    cmd = next((p for t in ("fp8", "tiers", "pd") if (p := kg / f"launch_dryrun_{t}.txt").exists()), None)
    if cmd is not None:
        first = next((line for line in cmd.read_text().splitlines() if line and not line.startswith("#")), "")
        lines += ["", "First replica's command line (`kvgate launch --dry-run`):", "", "```", first, "```"]
    return lines


def kill_section(kg: Path) -> list[str]:
    doc = _load(kg / "res" / "kill_restart" / "kill.json")
    if not doc:
        return []
    keys = (
        "victim",
        "rate",
        "traffic_off_s",
        "engine_healthy_again_s",
        "gateway_routes_again_s",
        "first_request_served_again_s",
        "sent_to_victim_while_out",
        "requests",
        "ok",
        "errors",
        "in_flight_at_kill",
        "in_flight_at_kill_failed",
        "failed_after_traffic_off",
    )
    return [f"- {k}: {doc.get(k)}" for k in keys]


def steps_section(kg: Path) -> list[str]:
    rows = ["| step | rc | seconds |", "|---|---|---|"]
    rows += [f"| {s['step']} | {s['rc']} | {s['seconds']} |" for s in steps(kg)]
    timing = kg / "timing.tsv"
    if timing.exists():
        rows += ["", "| driver step | seconds | call |", "|---|---|---|"]
        rows += [f"| {' | '.join(line.split(chr(9)))} |" for line in timing.read_text().splitlines() if line]
    return rows


def render(kg: Path, sim_root: Path | None) -> str:
    tables, found = scenario_tables(kg, sim_root)
    card = _load(kg / "card.json") or {"card": "h200", "shape": "llama-3.1-8b"}  # runs before card.py: H200s
    doc = [f"# kvgate on an {card['card'].upper()}: four vLLM 0.26.0 replicas launched by kvgate", ""]
    gpu = card.get("nvidia_smi") or "named by KG_CARD"
    kv = card.get("kv_cache_dtype", "fp8")
    doc += [
        f"Card: {card['card']} ({gpu}), model shape {card['shape']}, KV {kv}; simulator profile "
        f"{card.get('sim_profile', 'h200-llama3.1-8b')}",
        "",
    ]
    rates = kg / "rates.env"
    if rates.exists():
        doc += ["Rates: `" + rates.read_text().replace("\n", " ").strip() + "`", ""]
    doc += _section("Fleet", fleet_section(kg))
    doc += _section("Scenarios", tables)
    doc += _section("Targets", verdicts(found))
    doc += _section("A replica killed under load (kill -9 of its process group)", kill_section(kg))
    doc += _section("FP8 vs BF16 KV cache", dtype_section(kg, found))
    doc += _section("Steps", steps_section(kg))
    return "\n".join(doc) + "\n"


def run_sim(kg: Path, sim_root: Path) -> None:
    """The simulator's run of every H200 step that has no simulator report yet. Left out: the probes,
    and the BF16 fleet's steps, logged with the FP8 size's arguments (the engines were already
    running), so that the simulator would run them on an FP8 cache."""
    for step in steps(kg):
        out = step["out"]
        if out.startswith(("probe/", "bf16")) or (sim_root / out / "report.json").exists():
            continue
        args = [a.replace("{RES}", str(sim_root)) for a in step["args"]]
        print(f"simulator: {step['step']}: kvgate bench scenario {' '.join(args)}", flush=True)
        subprocess.call([sys.executable, "-m", "bench", "scenario", *args])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("kg", type=Path)
    p.add_argument("--sim", type=Path, help="the simulator's reports of the same steps")
    p.add_argument("--run-sim", action="store_true", help="run the missing simulator steps first")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.run_sim:
        if a.sim is None:
            p.error("--run-sim needs --sim")
        run_sim(a.kg, a.sim)
    text = render(a.kg, a.sim)
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
