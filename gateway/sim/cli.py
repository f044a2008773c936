"""`python -m gateway.sim` / `kvgate sim`: start simulated engine replicas from a `vllm serve` command line.

Every `vllm serve` flag the simulator models is accepted under vLLM's name (and a few SGLang spellings with
`--api sglang`); any other flag is accepted with a warning, so real launcher command lines run unchanged.
Simulator-only flags: --profile, --speedup, --max-waiting, --replicas, --gpu-share, --startup-delay, --api,
--fault-*, --crash-after, --default-max-tokens, --kv-lease-timeout.

`--tokenizer` is vLLM's flag: a tokenizer.json or a model directory holding one (as vLLM, the model's
own directory is used when `--model` is one), or, simulator-only, `builtin:words` (one token per word,
the GPU kit's tokenizer) or `builtin:cl100k` (the default). Every count, the KV cache's blocks and
`/tokenize` are then in that tokenizer's tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from gateway.prompt.tokens import TokenizerError, load_tokenizer, use_tokenizer
from gateway.sim.device import SharedDevice
from gateway.sim.engine import EngineConfig
from gateway.sim.faults import FaultConfig
from gateway.sim.kv_events import parse_kv_events_config
from gateway.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile
from gateway.sim.server import Replica, ReplicaOptions, serve
from gateway.sim.serving_flags import add_serving_flags, serving_options

log = logging.getLogger("gateway.sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgate sim", usage="%(prog)s [MODEL] [options]", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", "--model-path", dest="model")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, its directory, or builtin:words|cl100k")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="first replica's port (0: pick free ports)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-num-seqs", "--max-running-requests", type=int, default=1024)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--disable-radix-cache", action="store_true", help="SGLang spelling of no prefix caching")
    p.add_argument("--block-size", "--page-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=0.92)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache bytes per GPU")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--enable-priority-scheduling", action="store_true", help="SGLang spelling")
    p.add_argument("--kv-transfer-config", default=None, help="JSON; kv_role kv_producer|kv_consumer|kv_both")
    p.add_argument("--kv-offloading-size", type=float, default=None, help="GiB of CPU KV cache per replica")
    p.add_argument("--kv-offloading-backend", choices=["native", "lmcache"], default="native")
    p.add_argument("--kv-events-config", default=None, help="JSON; enable_kv_cache_events, endpoint, topic")
    p.add_argument("--tensor-parallel-size", "-tp", "--tp-size", type=int, default=None)
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default=None)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=None)
    add_serving_flags(p)  # tool calling, logprobs, LoRA, pooling (gateway.sim.serving_flags)
    sim = p.add_argument_group("simulator")
    sim.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    sim.add_argument("--speedup", type=float, default=1.0, help="simulated seconds per wall second")
    sim.add_argument("--max-waiting", "--max-queued-requests", type=int, default=None, help="429 beyond this")
    sim.add_argument("--replicas", type=int, default=1, help="independent replicas on consecutive ports")
    sim.add_argument(
        "--gpu-share",
        type=int,
        default=1,
        metavar="N",
        help="N replicas share one GPU: with --replicas a multiple of N, every N consecutive ones time-slice "
        "a device; a lone replica gets a static 1/N of it",
    )
    sim.add_argument("--startup-delay", type=float, default=0.0, help="seconds of 503 from /health")
    sim.add_argument("--api", choices=["vllm", "sglang"], default="vllm")
    sim.add_argument("--fault-error-rate", type=float, default=0.0)
    sim.add_argument("--fault-error-status", type=int, default=500)
    sim.add_argument("--fault-stall-rate", type=float, default=0.0)
    sim.add_argument("--fault-stall-s", type=float, default=0.0)
    sim.add_argument(
        "--crash-after", type=int, default=None, help="serve N generation requests, die at the next"
    )
    sim.add_argument("--fault-seed", type=int, default=0)
    sim.add_argument("--fault-kv-drop-rate", type=float, default=0.0, help="KV event batches not sent")
    sim.add_argument("--fault-kv-reorder-rate", type=float, default=0.0, help="KV event batches sent late")
    sim.add_argument("--default-max-tokens", type=int, default=64, help="output length without max_tokens")
    sim.add_argument("--kv-lease-timeout", type=float, default=30.0, help="PD prefill: hold blocks this long")
    sim.add_argument(
        "--kv-transfer-bw",
        type=float,
        default=None,
        help="PD decode: KV bytes/s from the prefill replica, shared by the transfers in flight (default: "
        "the profile's RDMA link; two vLLM processes on one H200 measured ~3.1e8 through NIXL's UCX for "
        "fragmented blocks, results/gpu/2026-12-02-pd)",
    )
    sim.add_argument("--log-level", default="info")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse like `vllm serve [MODEL] FLAGS...`; MODEL only as the first word, so that the values of
    unknown flags are never mistaken for it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    model_pos = argv.pop(0) if argv and not argv[0].startswith("-") else None
    args, unknown = build_parser().parse_known_args(argv)
    args.model_pos = model_pos
    for flag in unknown:
        if flag.startswith("-"):
            log.warning("ignoring engine flag the simulator does not model: %s", flag)
    return args


def replica_options(args: argparse.Namespace) -> list[ReplicaOptions]:
    profile = get_profile(
        args.profile, **({} if args.kv_transfer_bw is None else {"transfer_bw": args.kv_transfer_bw})
    )
    model = args.model or args.model_pos or "sim-model"
    chunked = args.enable_chunked_prefill
    budget = args.max_num_batched_tokens or (8192 if chunked else max(args.max_model_len, 2048))
    transfer = json.loads(args.kv_transfer_config) if args.kv_transfer_config else {}
    kv_role = transfer.get("kv_role", "kv_both") if transfer else None
    sglang = args.api == "sglang"
    mode = None if args.disaggregation_mode in (None, "null") else args.disaggregation_mode
    if sglang and mode is None and kv_role in ("kv_producer", "kv_consumer"):
        # The launcher gives a simulator vLLM's role flag even when it speaks SGLang.
        mode = "prefill" if kv_role == "kv_producer" else "decode"
    if sglang and mode is None and args.disaggregation_bootstrap_port is not None:
        mode = "prefill"
    if args.kv_offloading_size is not None and args.kv_offloading_backend != "native":
        raise ValueError("the simulator models only --kv-offloading-backend native")
    serving = serving_options(args)
    devices = _devices(args.replicas, args.gpu_share, profile.timeslice_efficiency)
    out = []
    for i in range(args.replicas):
        engine = EngineConfig(
            profile=profile,
            kv_cache_dtype=args.kv_cache_dtype,
            tp=args.tensor_parallel_size,
            block_size=args.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=args.enable_prefix_caching and not args.disable_radix_cache,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks=args.num_gpu_blocks_override,
            max_model_len=args.max_model_len,
            scheduling_policy="priority"
            if args.scheduling_policy == "priority" or args.enable_priority_scheduling or sglang
            else "fcfs",
            higher_priority_first=sglang,
            kv_lease_timeout_s=args.kv_lease_timeout,
            lora=serving.lora if serving.lora.enabled else None,
            gpu_share=args.gpu_share if devices is None else 1,
            kv_offloading_size=args.kv_offloading_size,
        )
        boot = args.disaggregation_bootstrap_port if mode == "prefill" else None
        if boot is None and mode == "prefill":
            boot = 8998
        out.append(
            ReplicaOptions(
                engine=engine,
                model=model,
                served_model_names=args.served_model_name or [model],
                host=args.host,
                port=args.port + i if args.port else 0,
                speedup=args.speedup,
                max_waiting=args.max_waiting,
                api=args.api,
                kv_role=kv_role,
                kv_load_failure_policy=transfer.get("kv_load_failure_policy", "fail"),
                disaggregation_mode=mode,
                bootstrap_port=boot + i if boot else boot,  # 0: an ephemeral port
                kv_events=parse_kv_events_config(args.kv_events_config),
                faults=FaultConfig(
                    args.fault_error_rate,
                    args.fault_error_status,
                    args.fault_stall_rate,
                    args.fault_stall_s,
                    args.crash_after,
                    args.fault_seed + i,
                    args.fault_kv_drop_rate,
                    args.fault_kv_reorder_rate,
                ),
                startup_delay_s=args.startup_delay,
                default_max_tokens=args.default_max_tokens,
                index=i,
                single_process_replica=args.replicas == 1,
                serving=serving,
                device=None if devices is None else devices[i // args.gpu_share],
            )
        )
    return out


def _devices(replicas: int, share: int, efficiency: float) -> list[SharedDevice] | None:
    """The GPUs the replicas of this process time-share, N consecutive replicas to each; None when each
    replica has a GPU of its own or, alone in its process, a static share of one (it cannot see the
    others)."""
    if share < 1:
        raise ValueError("--gpu-share must be at least 1")
    if share == 1 or replicas == 1:
        return None
    if replicas % share:
        raise ValueError(f"--replicas {replicas} is not a multiple of --gpu-share {share} (or 1)")
    return [SharedDevice(efficiency) for _ in range(replicas // share)]


def select_tokenizer(args: argparse.Namespace) -> None:
    """Count in `--tokenizer`'s tokens (or the model directory's, as vLLM does) in this process."""
    spec = args.tokenizer
    model = args.model or args.model_pos
    if spec is None and model and (Path(model) / "tokenizer.json").is_file():
        spec = model
    if spec is not None:
        tokenizer = load_tokenizer(spec)
        use_tokenizer(tokenizer)
        log.info("tokenizer %s", tokenizer.name)


async def _run(opts: list[ReplicaOptions]) -> None:
    replicas = [Replica(o) for o in opts]
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]
    with contextlib.suppress(asyncio.CancelledError):
        await serve(replicas)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        select_tokenizer(args)
        opts = replica_options(args)
        for o in opts[:1]:
            log.info(
                "profile %s (%s); replicas=%d speedup=%g api=%s",
                o.engine.profile.name,
                o.engine.profile.source,
                len(opts),
                o.speedup,
                o.api,
            )
    except (ValueError, json.JSONDecodeError, TokenizerError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(_run(opts))
    except OSError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 1
    return 0
