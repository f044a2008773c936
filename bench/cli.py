"""`kvgate bench` (also `python -m bench`): run workloads, replay traces, compare configurations.

kvgate bench list
kvgate bench run --workload shared-prefix --set groups=8 --rate 4 --target http://127.0.0.1:8000
kvgate bench replay --trace conversation --length-scale 0.1 --time-scale 0.05 --target URL
kvgate bench scenario routing --quick
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import loadgen, procs
from bench.client import ClientOptions
from bench.faults import FaultScenario, run_faults
from bench.faults import markdown as fault_markdown
from bench.loadgen import LoadSpec
from bench.report import summary_table, write_reports
from bench.scenario import (
    DEFAULT_OUT,
    ExistingFleet,
    RunPoint,
    available_scenarios,
    deep_merge,
    load_scenario,
    point_from_result,
    run_scenario,
)
from bench.stats import summarize
from bench.workloads import WORKLOADS, make_workload

DEFAULT_TARGET = f"http://{procs.HOST}:8000"


def _parse_sets(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def _parse_headers(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise SystemExit(f"--header expects NAME:VALUE, got {pair!r}")
        out[name.strip().lower()] = value.strip()
    return out


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, action="append", default=[], help="Poisson req/s; repeat for sweeps")
    g.add_argument("--concurrency", type=int, action="append", default=[], help="closed loop with C clients")
    g.add_argument("--trace-arrivals", action="store_true", help="send at the workload's own timestamps")
    g.add_argument("--duration", type=float, help="stop sending after this many seconds")
    g.add_argument("--max-requests", type=int)
    g.add_argument("--warmup-requests", type=int, default=0, help="sent first, left out of the statistics")
    g.add_argument("--warmup-s", type=float, default=0.0)
    g.add_argument("--drain-timeout", type=float, default=120.0, help="wait for in-flight requests (s)")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument(
        "--target",
        action="append",
        default=[],
        help=f"gateway or engine base URL; repeat to round-robin over engines (default {DEFAULT_TARGET})",
    )
    g.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    g.add_argument("--api", choices=["chat", "completions"], default="chat")
    g.add_argument("--api-key")
    g.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra request header")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (plain OpenAI)")
    g.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    g.add_argument("--label", default="target", help="name of this configuration in the report")
    g.add_argument("--prime", type=int, default=1, help="unmeasured tiny requests sent first")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", type=Path, help="report directory (default results/out/<workload>)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list workloads and scenarios")

    run = sub.add_parser("run", help="run one workload against running targets")
    run.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="workload parameter")
    _add_target_args(run)
    _add_load_args(run)

    replay = sub.add_parser("replay", help="replay a Mooncake trace at its own timestamps")
    replay.add_argument("--trace", default="conversation", help="conversation | synthetic | a .jsonl name")
    replay.add_argument("--data-dir", help="trace folder (default ../shared/data/mooncake from the repo)")
    replay.add_argument("--length-scale", type=float, default=1.0, help="scale block size and lengths")
    replay.add_argument("--output-scale", type=float, help="scale output lengths (default: length scale)")
    replay.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival offsets")
    replay.add_argument("--start-s", type=float, default=0.0, help="skip the trace before this offset")
    replay.add_argument("--max-input-tokens", type=int, help="drop longer (scaled) prompts")
    _add_target_args(replay)
    _add_load_args(replay)

    scen = sub.add_parser("scenario", help="side-by-side comparison with its own fleet and gateways")
    scen.add_argument("scenario", help=f"built-in name ({', '.join(available_scenarios())}) or a YAML path")
    size = scen.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="size", const="quick", help="CI size (<1 min)")
    size.add_argument("--size", default="full", help="a size the scenario defines (default full)")
    scen.add_argument("--only", help="comma-separated config names to run")
    scen.add_argument("--baseline", help="config the ratios are relative to")
    scen.add_argument("--out", type=Path, help="report directory (default results/out/<scenario>)")
    scen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="workload parameter")
    scen.add_argument("--rate", type=float, action="append", default=[], help="replace the load points")
    scen.add_argument("--concurrency", type=int, action="append", default=[], help="replace the load points")
    scen.add_argument("--speedup", type=float, help="simulator speedup (default: the scenario's)")
    scen.add_argument("--profile", help="simulator profile (default: the scenario's)")
    scen.add_argument("--seed", type=int, help="workload and arrival seed")
    fleet = scen.add_argument_group("existing engines (instead of a simulated fleet)")
    fleet.add_argument(
        "--endpoints",
        nargs="+",
        metavar="URL",
        help="run every configuration against these running engines; their prefix caches are reset "
        "before each run (vLLM: needs VLLM_SERVER_DEV_MODE=1)",
    )
    fleet.add_argument(
        "--kv-events",
        nargs="+",
        metavar="ENDPOINT",
        help="the engines' KV event publishers (tcp://HOST:PORT), one per --endpoints URL, for "
        "configurations in precise mode",
    )
    fleet.add_argument(
        "--kv-events-replay",
        nargs="+",
        metavar="ENDPOINT",
        help="their replay sockets (vLLM's replay_endpoint), one per --endpoints URL: batches the "
        "gateway misses are asked for there",
    )
    fleet.add_argument(
        "--devices",
        nargs="+",
        metavar="DEVICE",
        help="the GPU each --endpoints engine runs on, one per URL ('-': a GPU of its own); engines "
        "naming the same device share it (the gateways' endpoints[].device)",
    )
    fleet.add_argument(
        "--roles",
        nargs="+",
        choices=["mixed", "prefill", "decode"],
        help="what each --endpoints engine was launched as, one per URL: configurations with a "
        "prefill/decode split take their legs from these (engines of both roles serve plain requests too)",
    )
    fleet.add_argument("--engine-kind", choices=["vllm", "sglang", "sim"], default="vllm")
    fleet.add_argument("--model", help="the model name the engines serve (default: the scenario's)")
    return parser


def _loads(args: argparse.Namespace, trace_default: bool) -> list[LoadSpec]:
    common: dict[str, Any] = {
        "duration_s": args.duration,
        "max_requests": args.max_requests,
        "warmup_requests": args.warmup_requests,
        "warmup_s": args.warmup_s,
        "drain_timeout_s": args.drain_timeout,
        "seed": args.seed,
    }
    loads = [LoadSpec(mode="poisson", rate=r, **common) for r in args.rate]
    loads += [LoadSpec(mode="closed", concurrency=c, **common) for c in args.concurrency]
    if args.trace_arrivals or (trace_default and not loads):
        loads.append(LoadSpec(mode="trace", **common))
    if not loads:
        raise SystemExit("give a load: --rate R, --concurrency C or --trace-arrivals")
    return loads


def _run_workload(args: argparse.Namespace, workload_name: str, params: dict[str, Any], trace: bool) -> int:
    workload = make_workload(workload_name, params)
    requests = workload.build(args.seed)
    targets = args.target or [DEFAULT_TARGET]
    opts = ClientOptions(
        model=args.model,
        api=args.api,
        ignore_eos=not args.no_ignore_eos,
        timeout_s=args.timeout,
        api_key=args.api_key,
        extra_headers=_parse_headers(args.header),
    )
    points: list[RunPoint] = []
    for load in _loads(args, trace):
        print(f"[{workload_name}] {args.label} @ {load.label} -> {', '.join(targets)} ...", flush=True)
        result = loadgen.run_sync(loadgen.run(requests, load, targets, opts, args.prime))
        summary = summarize(result)
        for warning in summary["warnings"]:
            print(f"    WARNING: {warning}", file=sys.stderr)
        points.append(point_from_result(args.label, result, summary))
    out = args.out or DEFAULT_OUT / workload_name
    meta = {
        "workload": f"{workload_name} {params}",
        "seed": args.seed,
        "requests built": len(requests),
        "targets": ", ".join(targets),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    paths = write_reports(out, f"kvgate bench: {workload_name}", points, args.label, meta)
    print(summary_table(points, args.label))
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    return 0


def _faults(scenario: FaultScenario, args: argparse.Namespace) -> int:
    size = args.size or "full"
    if args.speedup is not None:
        scenario.fleet.speedup = args.speedup
    if args.profile:
        scenario.fleet.profile = args.profile
    if args.seed is not None:
        scenario.seed = args.seed
    if args.model:
        scenario.fleet.model = args.model
    out = args.out or DEFAULT_OUT / scenario.name
    variants = scenario.variants or {"": {}}
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
        if not variants:
            raise ValueError(f"--only {args.only}: the scenario's variants are {sorted(scenario.variants)}")
    codes = [
        _fault_run(replace(scenario, gateway=deep_merge(scenario.gateway, v)), name, size, out, args)
        for name, v in variants.items()
    ]
    return max(codes)


def _fault_run(scenario: FaultScenario, variant: str, size: str, out: Path, args: argparse.Namespace) -> int:
    """One run of a fault schedule (under one of its gateway variants)."""
    out = out / variant if variant else out
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"{variant}: {message}" if variant else message, flush=True)

    result = run_faults(scenario, size, out, progress, args.endpoints, args.engine_kind)
    meta = {
        "scenario": f"{scenario.name} ({', '.join(filter(None, (size, variant)))}): {scenario.description}",
        "fleet": f"{len(args.endpoints)} existing {args.engine_kind} engines: {' '.join(args.endpoints)}"
        if args.endpoints
        else f"{scenario.fleet.replicas} x {scenario.fleet.module} profile {scenario.fleet.profile}, "
        f"speedup {scenario.fleet.speedup:g}",
        "load": f"{scenario.load.concurrency} streaming clients in a closed loop, "
        f"{scenario.load.max_tokens} tokens each",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    md = fault_markdown(result, f"kvgate bench scenario: {scenario.name}", meta)
    (out / "report.json").write_text(json.dumps({"meta": meta, **result}, indent=2))
    (out / "report.md").write_text(md)
    print(md)
    print(
        f"finished in {time.monotonic() - started:.0f} s; reports: {out / 'report.md'}, {out / 'report.json'}"
    )
    return 0 if result["lost"] == 0 and result["wrong_client"] == 0 else 1


def _scenario(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    if isinstance(scenario, FaultScenario):
        return _faults(scenario, args)
    if args.baseline:
        scenario.baseline = args.baseline
    only = args.only.split(",") if args.only else None
    size = args.size or "full"
    size_spec = scenario.size(size)
    size_spec.workload.update(_parse_sets(args.set))
    if args.rate or args.concurrency:
        # A new rate keeps the size's arrival shape (bursts), only the rate changes.
        rated = [p for p in size_spec.loads if "rate" in p]
        shape = {k: v for k, v in rated[0].items() if k != "rate"} if rated else {}
        size_spec.loads = [{**shape, "rate": r} for r in args.rate] + [
            {"concurrency": c} for c in args.concurrency
        ]
    if args.speedup is not None:
        size_spec.fleet["speedup"] = args.speedup
    if args.profile:
        size_spec.fleet["profile"] = args.profile
    if args.seed is not None:
        scenario.seed = args.seed
    if args.model:
        scenario.fleet.model = args.model
    existing = None
    if args.endpoints:
        devices = [None if d == "-" else d for d in args.devices] if args.devices else None
        existing = ExistingFleet(
            args.endpoints,
            args.kv_events,
            args.engine_kind,
            devices=devices,
            roles=args.roles,
            kv_events_replay=args.kv_events_replay,
        )
    elif args.kv_events or args.kv_events_replay or args.devices or args.roles:
        raise ValueError("--kv-events, --kv-events-replay, --devices and --roles go with --endpoints")
    out = args.out or DEFAULT_OUT / scenario.name
    started = time.monotonic()
    failures: list[str] = []
    points = run_scenario(scenario, size, out, only, lambda m: print(m, flush=True), failures, existing)
    if not points:
        raise ValueError("every configuration failed:\n" + "\n".join(failures))
    ran = [p.config for p in points]
    baseline = scenario.baseline_name if scenario.baseline_name in ran else ran[0]
    meta = {
        "scenario": f"{scenario.name} ({size}): {scenario.description}".strip(),
        "workload": f"{scenario.workload} {size_spec.workload}",
        "seed": scenario.seed,
        "fleet": f"{scenario.fleet.module} profile {scenario.fleet.profile}, overrides {size_spec.fleet}"
        if existing is None
        else f"existing {existing.kind} engines {', '.join(existing.urls)} (the scenario's fleet settings "
        f"describe them, they are not applied: {size_spec.fleet})",
        "loads": ", ".join(str(p) for p in size_spec.loads),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if failures:
        meta["FAILED"] = "; ".join(failures)
    paths = write_reports(out, f"kvgate bench scenario: {scenario.name}", points, baseline, meta)
    print(f"\n{scenario.name} ({size}), ratios against {baseline}; every figure in {paths['markdown']}\n")
    print(summary_table(points, baseline))
    print(f"finished in {time.monotonic() - started:.0f} s")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    return 1 if failures else 0


def _list() -> int:
    print("workloads:")
    for name, cls in sorted(WORKLOADS.items()):
        print(f"  {name:24s} {cls.summary}")
    print("scenarios:")
    for name in available_scenarios():
        scenario = load_scenario(name)
        configs = (
            "faults" if isinstance(scenario, FaultScenario) else ", ".join(c.name for c in scenario.configs)
        )
        print(f"  {name:24s} {scenario.description} [{configs}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    procs.raise_keyboard_interrupt_on_sigterm()
    try:
        if args.command == "list":
            return _list()
        if args.command == "run":
            return _run_workload(args, args.workload, _parse_sets(args.set), trace=False)
        if args.command == "replay":
            params = {
                "trace": args.trace,
                "data_dir": args.data_dir,
                "length_scale": args.length_scale,
                "output_scale": args.output_scale,
                "time_scale": args.time_scale,
                "start_s": args.start_s,
                "max_input_tokens": args.max_input_tokens,
            }
            if args.max_requests is not None:  # else the workload's bounded default, not the whole trace
                params["max_requests"] = args.max_requests
            return _run_workload(args, "mooncake", params, trace=True)
        return _scenario(args)
    except KeyboardInterrupt:
        print("interrupted; child processes stopped", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, procs.ProcessError, loadgen.TargetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
