"""The `vllm serve` flags that decide what the API accepts (tool calling, logprobs, LoRA, pooling), kept out
of cli.py so that the launcher-facing flags there stay small.

vLLM's names and defaults: `--enable-auto-tool-choice` and `--tool-call-parser NAME` (without a parser,
`tool_choice` "required" or a named function is a 400, and so is "auto" without both flags),
`--max-logprobs` (20), `--enable-lora`, `--lora-modules`, `--max-loras` (1), `--max-lora-rank` (16),
`--max-cpu-loras`, `--enable-request-id-headers` (every answer echoes the request's X-Request-Id),
`--runner generate|pooling|auto` with `--convert embed` (and the older `--task embed`):
a pooling model serves embeddings/pooling/score/rerank and not generation, as vLLM registers routes by
the model's tasks. Simulator only: `--embedding-dim` (1024), the length of the vectors it returns.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from gateway.sim.lora import LoraConfig, parse_lora_modules, runtime_updating_allowed

log = logging.getLogger("gateway.sim")


@dataclass(slots=True)
class ServingOptions:
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    max_logprobs: int = 20
    runner: str = "generate"  # or "pooling" (embedding models)
    embedding_dim: int = 1024
    lora: LoraConfig = field(default_factory=LoraConfig)
    request_id_headers: bool = False


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto")
    p.add_argument("--convert", default=None, help="embed: serve the model as an embedding model")
    p.add_argument("--task", default=None, help="older spelling: --task embed")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-modules", nargs="+", default=[])
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--enable-request-id-headers", action="store_true", help="echo X-Request-Id in answers")
    p.add_argument("--embedding-dim", type=int, default=1024, help="simulator: length of embedding vectors")


def serving_options(args: argparse.Namespace) -> ServingOptions:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    pooling_task = args.task in ("embed", "embedding", "score", "reward", "classify")
    if args.task is not None:
        log.warning("--task is deprecated in vLLM; use --runner pooling --convert embed")
    runner = args.runner
    if runner == "auto":
        runner = "pooling" if (args.convert == "embed" or pooling_task) else "generate"
    modules = parse_lora_modules(args.lora_modules)
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.max_loras < 1 or args.embedding_dim < 1:
        raise ValueError("--max-loras and --embedding-dim must be at least 1")
    lora = LoraConfig(
        enabled=args.enable_lora,
        modules=modules,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        runtime_updating=runtime_updating_allowed(),
    )
    return ServingOptions(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_logprobs=args.max_logprobs,
        runner=runner,
        embedding_dim=args.embedding_dim,
        lora=lora,
        request_id_headers=args.enable_request_id_headers,
    )
