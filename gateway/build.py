"""Which of the request path's modules run compiled and which from their Python source.

`KVGATE_COMPILE=1 pip install .` compiles the modules in `COMPILED` with mypyc (setup.py says when),
from the same source an editable install runs interpreted; the gateway reports which ran at
start-up and in `/metrics`. Standard library only: setup.py reads `COMPILED` from this file before
any of the gateway's dependencies is installed."""

from __future__ import annotations

import importlib
from importlib.machinery import EXTENSION_SUFFIXES

# On every request's path, and compiled by mypyc without a change of meaning; `make test-compiled`
# runs the suites that cover them against the compiled build. What was measured, and which modules
# mypyc refused as they are: results/overhead/README.md, "Compiled modules".
COMPILED = (
    "gateway.http.httptools_server",
    "gateway.http.handling",
    "gateway.http.request_body",
    "gateway.http.conn_guard",
    "gateway.path.transports.http1",
    "gateway.path.request",
    "gateway.path.exchange",
    "gateway.path.prepare",
    "gateway.path.deadlines",
    "gateway.path.claim",
    "gateway.path.request_record",
    "gateway.path.sse_events",
    "gateway.path.stream_end",
    "gateway.routing.pool_router",
    "gateway.prompt.tokens",
)


def compiled_modules() -> list[str]:
    """The modules of `COMPILED` that this process loaded from a compiled extension."""
    return [
        name
        for name in COMPILED
        if (importlib.import_module(name).__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))
    ]


def build_kind() -> str:
    """`compiled` (all of `COMPILED`), `interpreted` (none) or `mixed` (a partial or stale build)."""
    count = len(compiled_modules())
    return "compiled" if count == len(COMPILED) else "interpreted" if count == 0 else "mixed"
