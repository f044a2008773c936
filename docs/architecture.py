"""Draws docs/architecture.png: kvgate's packages and a request's path through them.

    .venv/bin/python docs/architecture.py   # matplotlib, from the `bench` extra (in `dev`)

The picture is docs/architecture.md's two diagrams side by side; edit both together. What it shows
is the README's module map and `tests/test_layering.py`'s rules, which hold the facts.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parent / "architecture.png"

# Packages, top to bottom: (name, what it owns, x, y). Imports run downwards only.
PACKAGES = [
    ("top", "cli, server, runtime:\nthe composition root", 2.0, 9.0),
    ("http", "the data plane's surface,\nthe two HTTP servers", 0.4, 7.4),
    ("control", "admin API, reload,\nshared state", 2.0, 7.4),
    ("observe", "metrics, tracing,\naccess log, dashboard", 3.6, 7.4),
    ("path", "one request: prepare, attempts,\nrelay, hand-off, upstream", 2.0, 5.8),
    ("admission", "scheduler, classes,\nlimits", 2.0, 4.4),
    ("routing", "model catalog, pool router,\nDecision, policy seam, indexes", 2.0, 3.0),
    ("prompt", "endpoints, canonicalize,\ntokens, prefix hashes", 0.4, 1.6),
    ("fleet", "replicas, launcher, engine\nadapters + connectors", 2.0, 1.6),
    ("base", "config, errors, logs", 2.0, 0.3),
]
BESIDE = [
    ("policies/", "built-in policies,\nlike a user's plugin", 4.3, 4.4),
    ("facade", "gateway.policy:\nthe plugin API", 4.3, 3.0),
    ("sim", "the engine simulator\n(shares prompt.tokens)", 4.3, 1.6),
]
LAYER_EDGES = [
    ("top", "http"),
    ("top", "control"),
    ("top", "observe"),
    ("http", "path"),
    ("control", "path"),
    ("observe", "path"),
    ("path", "admission"),
    ("admission", "routing"),
    ("routing", "prompt"),
    ("routing", "fleet"),
    ("prompt", "base"),
    ("fleet", "base"),
]
SIDE_EDGES = [("policies/", "facade"), ("facade", "routing")]

# A request's path, in path/proxy's named steps: (step, modules).
PATH = [
    ("client", "OpenAI SDK"),
    ("HTTP server", "http/httptools_server (or aiohttp_server),\nconn_guard, request_body, tenant_caps"),
    ("envelope, auth", "http/app, http/auth"),
    (
        "prepare",
        "path/prepare: routing/model_catalog, path/sanitize,\nprompt/canonicalize, tokens, prefix_hash",
    ),
    ("admit", "admission/scheduler: classes, SJF + aging,\nadmission on engine load (429/503)"),
    ("decide", "routing/pool_router.route -> a Decision:\nthe policy ranks (both legs in a PD pool)"),
    ("attempts", "path/attempts: claim, budget, backoff, one outcome\neach; path/handoff: the prefill leg"),
    ("to the engine", "path/upstream + transports/ (http1 or aiohttp)"),
    ("engine", "fleet: a replica; its adapter speaks its dialect"),
    ("relay the answer", "path/relay: model_names, sse_events,\nresume (mid-stream failover)"),
]
# The loops back to `attempts`, each an outcome of one attempt: (from step, label).
LOOPS = [
    ("to the engine", "Refused / Failed before the first byte:\nthe next candidate"),
    ("engine", "Unfetched (the hand-off's KV lost):\nagain without the hand-off"),
    ("relay the answer", "Broken mid-answer: the continuation,\nranked again, on another replica"),
]


def box(ax, x, y, w, h, title, text, color):
    ax.add_patch(
        FancyBboxPatch(
            (x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05", fc=color, ec="#333333", lw=1.0
        )
    )
    ax.text(x, y + h / 2 - 0.18, title, ha="center", va="top", fontsize=9, fontweight="bold")
    ax.text(x, y - 0.08, text, ha="center", va="top", fontsize=6.5)


def arrow(ax, start, end, style="-|>", color="#333333", dashed=False):
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle=style,
            mutation_scale=10,
            color=color,
            lw=1.0,
            linestyle="--" if dashed else "-",
        )
    )


def packages(ax):
    w, h = 1.45, 0.95
    where = {}
    for name, text, x, y in PACKAGES:
        box(ax, x, y, w, h, name, text, "#dbe9f6")
        where[name] = (x, y)
    for name, text, x, y in BESIDE:
        box(ax, x, y, w, h, name, text, "#f3e6cf")
        where[name] = (x, y)
    for a, b in LAYER_EDGES:
        (xa, ya), (xb, yb) = where[a], where[b]
        arrow(ax, (xa, ya - h / 2 - 0.05), (xb, yb + h / 2 + 0.05))
    for a, b in SIDE_EDGES:
        (xa, ya), (xb, yb) = where[a], where[b]
        if ya == yb or abs(xa - xb) > 1:  # sideways into the routing box
            arrow(ax, (xa - w / 2 - 0.05, ya), (xb + w / 2 + 0.05, yb), dashed=True)
        else:
            arrow(ax, (xa, ya - h / 2 - 0.05), (xb, yb + h / 2 + 0.05), dashed=True)
    (xs, ys), (xp, yp) = where["sim"], where["prompt"]  # the simulator shares the token counter
    ax.add_patch(
        FancyArrowPatch(
            (xs, ys - h / 2 - 0.05),
            (xp, yp - h / 2 - 0.05),
            arrowstyle="-|>",
            mutation_scale=10,
            lw=1.0,
            linestyle="--",
            connectionstyle="arc3,rad=-0.25",
        )
    )
    ax.set_xlim(-0.5, 5.2)
    ax.set_ylim(-0.4, 9.7)
    ax.set_title("Packages: imports run downwards only (tests/test_layering.py)", fontsize=10)
    ax.axis("off")


def request_path(ax):
    n = len(PATH)
    step = 1.1
    for i, (title, text) in enumerate(PATH):
        y = (n - 1 - i) * step
        color = "#e4f2e1" if title not in ("client", "engine") else "#eeeeee"
        box(ax, 0, y, 3.6, 0.78, title, text, color)
        if i:
            arrow(ax, (0, y + step - 0.45), (0, y + 0.45))
    steps = [title for title, _ in PATH]
    attempts_y = (n - 1 - steps.index("attempts")) * step
    for k, (source, label) in enumerate(LOOPS):
        y = (n - 1 - steps.index(source)) * step
        x = 1.8 + 0.05 * k
        ax.add_patch(
            FancyArrowPatch(
                (x, y),
                (x, attempts_y),
                arrowstyle="-|>",
                mutation_scale=10,
                color="#a33",
                lw=1.0,
                connectionstyle=f"arc3,rad={0.35 + 0.2 * k}",
            )
        )
        ax.text(
            2.15 + 0.55 * k, (y + attempts_y) / 2, label, ha="left", va="center", fontsize=6, color="#a33"
        )
    ax.text(
        2.05,
        (n - 1) * step - 1.0,
        "observe/: metrics, traces,\naccess log, dashboard\nhear each step",
        ha="left",
        va="center",
        fontsize=7,
        style="italic",
    )
    ax.set_xlim(-1.9, 4.6)
    ax.set_ylim(-0.6, (n - 1) * step + 0.6)
    ax.set_title("A request's path", fontsize=10)
    ax.axis("off")


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 8), gridspec_kw={"width_ratios": [1, 1.2]})
    packages(left)
    request_path(right)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
