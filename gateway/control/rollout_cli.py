"""`kvgate rollout ...`: watch and steer a rollout on a running gateway through its admin API,
on the gateway's control listener (the URL it logs at start: `kvgate control plane on URL`).

    kvgate rollout status  --admin http://127.0.0.1:9001 --admin-key K [--json]
    kvgate rollout weights --admin ... --admin-key K MODEL POOL=WEIGHT [POOL=WEIGHT ...] [--rule N]

`status` prints each route's rules, then its variants side by side: weight and share in the
route's split (its last rule), requests and errors since start, error rate, TTFT and e2e
percentiles over the gateway's recent window. Rollback is `weights MODEL CANARY_POOL=0`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from gateway.config import check_weight

COLUMNS = (
    ("variant", "<"),
    ("weight", ">"),
    ("share", ">"),
    ("reqs", ">"),
    ("errors", ">"),
    ("err% win", ">"),
    ("ttft p50", ">"),
    ("ttft p95", ">"),
    ("ttft p99", ">"),
    ("e2e p50", ">"),
    ("e2e p95", ">"),
)


class AdminError(Exception):
    pass


def call(url: str, key: str | None, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read())["error"]
            message = error["message"]
        except (ValueError, KeyError, TypeError):
            error, message = {}, exc.reason
        if error.get("code") == "not_found":  # no such path: the data plane's port, say
            message += " (is this the gateway's control plane, control.host:control.port?)"
        raise AdminError(f"{method} {path}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AdminError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def _describe_rule(rule: dict[str, Any]) -> str:
    parts = []
    if rule.get("match"):
        parts.append("match " + ", ".join(f"{k}={v}" for k, v in rule["match"]["headers"].items()))
    pools = rule["pools"]
    if len(pools) == 1:
        parts.append(f"-> {pools[0]['name']}")
    else:
        parts.append("split " + " / ".join(f"{p['name']} {p['weight']:g}" for p in pools))
    if rule.get("sticky"):
        parts.append(f"sticky {rule['sticky']['key']} salt {rule['sticky']['salt']!r}")
    return ", ".join(parts)


def format_status(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for model, route in data["routes"].items():
        lines.append(f"route {model}")
        for i, rule in enumerate(route["rules"]):
            lines.append(f"  rule {i}: {_describe_rule(rule)}")
        rows = []
        for name, v in route["variants"].items():
            s = v.get("stats") or {}
            err = s.get("window_error_rate")
            rows.append(
                (
                    name,
                    "-" if v["weight"] is None else f"{v['weight']:g}",
                    "-" if v["share"] is None else f"{v['share'] * 100:.1f}%",
                    str(s.get("requests_total", 0)),
                    str(s.get("errors_total", 0)),
                    "-" if err is None else f"{err * 100:.1f}%",
                    _ms((s.get("ttft_ms") or {}).get("p50")),
                    _ms((s.get("ttft_ms") or {}).get("p95")),
                    _ms((s.get("ttft_ms") or {}).get("p99")),
                    _ms((s.get("e2e_ms") or {}).get("p50")),
                    _ms((s.get("e2e_ms") or {}).get("p95")),
                )
            )
        lines += _table(rows)
        lines.append("")
    if not data["routes"]:
        lines.append("no routes configured (clients address pools by their model name)")
    state = data.get("state") or {}
    if state:
        extra = f", {state['peers']} peer gateways" if "peers" in state else ""
        lines.append(
            f"state: {state['backend']} ({'connected' if state['connected'] else 'DISCONNECTED'}{extra})"
        )
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(c[0]), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(f"{v:{a}{w}}" for v, (_, a), w in zip(cells, COLUMNS, widths, strict=True)).rstrip()

    return ["  " + fmt(tuple(c[0] for c in COLUMNS)), *("  " + fmt(r) for r in rows)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate rollout", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("status", "variants side by side"), ("weights", "set a route rule's weights")):
        s = sub.add_parser(name, help=help_)
        s.add_argument(
            "--admin",
            default=os.environ.get("KVGATE_ADMIN_URL", "http://127.0.0.1:9001"),
            help="the gateway's control plane URL (control.host:control.port), or $KVGATE_ADMIN_URL",
        )
        s.add_argument("--admin-key", default=os.environ.get("KVGATE_ADMIN_KEY"), help="or $KVGATE_ADMIN_KEY")
    status = sub.choices["status"]
    status.add_argument("--json", action="store_true", help="print the raw /admin/rollouts document")
    weights = sub.choices["weights"]
    weights.add_argument("model")
    weights.add_argument("weights", nargs="+", metavar="POOL=WEIGHT")
    weights.add_argument("--rule", type=int, help="rule index (default: the route's last rule)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "status":
            data = call(args.admin, args.admin_key, "GET", "/admin/rollouts")
            print(json.dumps(data, indent=2) if args.json else format_status(data))
            return 0
        weights: dict[str, float] = {}
        for item in args.weights:
            pool, sep, value = item.partition("=")
            try:
                weights[pool] = float(value)
            except ValueError:
                sep = ""
            if not sep or not pool:
                print(f"kvgate rollout: expected POOL=WEIGHT, got {item!r}", file=sys.stderr)
                return 2
            try:
                check_weight(weights[pool])
            except ValueError as exc:
                print(f"kvgate rollout: {item}: {exc}", file=sys.stderr)
                return 2
        body: dict[str, Any] = {"weights": weights}
        if args.rule is not None:
            body["rule"] = args.rule
        result = call(
            args.admin,
            args.admin_key,
            "PUT",
            f"/admin/routes/{urllib.parse.quote(args.model, safe='')}/weights",
            body,
        )
        print(f"route {result['model']} rule {result['rule']}: {result['previous']} -> {result['weights']}")
        return 0
    except AdminError as exc:
        print(f"kvgate rollout: {exc}", file=sys.stderr)
        return 1
