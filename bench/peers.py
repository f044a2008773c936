"""Other routers in front of the same engines, for side-by-side runs: SGLang's router (sglang-router
0.3.2, `pip install -e ".[bench-peers]"`) and its successor SMG (`smg` 1.13.0, the Shepherd Model
Gateway). Both are Rust routers in one Python-launched process that take the engines' URLs and a
policy on their command line and speak the OpenAI API to vLLM.

A scenario configuration with `mode: peer` runs one of them instead of a kvgate gateway:
    - name: smg
      mode: peer
      peer: {router: smg, policy: cache_aware}
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from bench.procs import HOST, free_port_range, python_module

# The router's launcher module and how to install it.
ROUTERS = {
    "sglang-router": (
        "sglang_router.launch_router",
        'pip install -e ".[bench-peers]"  (sglang-router==0.3.2)',
    ),
    "smg": ("smg.launch_router", "pip install smg==1.13.0"),
}


def peer_argv(
    router: str,
    worker_urls: Sequence[str],
    port: int,
    policy: str = "round_robin",
    args: Sequence[str] = (),
) -> list[str]:
    """The command line of `router` listening on `port` in front of `worker_urls`."""
    try:
        module, install = ROUTERS[router]
    except KeyError:
        raise ValueError(f"unknown peer router {router!r}: one of {sorted(ROUTERS)}") from None
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise SystemExit(f"the {router} peer needs the router installed: {install}")
    # Each router serves Prometheus metrics on a port of its own (29000 by default): a free one, so
    # that two runs in a row, or a router beside a kvgate gateway, never collide.
    return python_module(
        module,
        *("--host", HOST, "--port", str(port), "--worker-urls", *worker_urls),
        *("--policy", policy, "--log-level", "warn"),
        *("--prometheus-host", HOST, "--prometheus-port", str(free_port_range(1))),
        *args,
    )


def peer_from_config(peer: dict[str, Any], worker_urls: Sequence[str], port: int) -> list[str]:
    """A scenario configuration's `peer: {router, policy, args}` as a command line."""
    unknown = set(peer) - {"router", "policy", "args"}
    if unknown or "router" not in peer:
        raise ValueError(f"peer needs `router` (and may have policy, args), not {sorted(unknown)}")
    return peer_argv(
        peer["router"], worker_urls, port, peer.get("policy", "cache_aware"), list(peer.get("args") or [])
    )
