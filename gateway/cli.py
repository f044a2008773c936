"""The `kvgate` command: serve, epp, check-config, config reference, launch --dry-run, render k8s,
sim, bench, rollout."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from gateway.config import ConfigError, Settings, load_config

DEFAULT_CONFIG = "embedded default (a fleet of simulated engines)"


def default_config_path() -> Path:
    return Path(str(resources.files("gateway").joinpath("default_config.yaml")))


def _load(path: str | None) -> Settings:
    return load_config(path if path else default_config_path())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate", description="Prefix-aware gateway for self-hosted LLM engines")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the gateway (and launch the managed engines)")
    s.add_argument("--config", "-c", help=f"YAML config (default: {DEFAULT_CONFIG})")
    s.add_argument("--host", help="override server.host")
    s.add_argument("--port", type=int, help="override server.port")
    e = sub.add_parser(
        "epp", help="run as the Endpoint Picker of an Envoy gateway (ext_proc over gRPC; docs/epp.md)"
    )
    e.add_argument("--config", "-c", help=f"YAML config (default: {DEFAULT_CONFIG})")
    e.add_argument("--host", help="override epp.host")
    e.add_argument("--port", type=int, help="override epp.port")
    c = sub.add_parser("check-config", help="validate a config file and exit")
    c.add_argument("config")
    ref = sub.add_parser("config", help="the settings reference: every key, its type, default and meaning")
    ref.add_argument("what", choices=["reference"], help="reference: print docs/settings.md (Markdown)")
    launch = sub.add_parser("launch", help="show the engine command lines a config launches")
    launch.add_argument("config", nargs="?")
    launch.add_argument("--dry-run", action="store_true", required=True, help="print, do not start")
    sub.add_parser("sim", help="run the bundled engine simulator (vllm serve flags; see `kvgate sim --help`)")
    sub.add_parser("bench", help="benchmarks and side-by-side scenarios (see `kvgate bench --help`)")
    sub.add_parser("rollout", help="rollout status of a running gateway (see `kvgate rollout --help`)")
    sub.add_parser(
        "render", help="Kubernetes manifests for a config's engines (see `kvgate render k8s --help`)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # These own their flags (the simulator mirrors `vllm serve`), so pass them through untouched.
    if argv and argv[0] == "sim":
        from gateway.sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv and argv[0] == "bench":
        try:
            from bench.cli import main as bench_main
        except ModuleNotFoundError as exc:  # an install without the bench extra (the Docker image's)
            if exc.name is None or exc.name.startswith(("bench", "gateway")):
                raise
            print(f"kvgate bench needs {exc.name}: pip install 'kvgate[bench]'", file=sys.stderr)
            return 2
        return bench_main(argv[1:])
    if argv and argv[0] == "rollout":
        from gateway.control.rollout_cli import main as rollout_main

        return rollout_main(argv[1:])
    if argv and argv[0] == "render":
        from gateway.fleet.render_k8s import main as render_main

        return render_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "config":
        from gateway.config import settings_reference

        print(settings_reference(), end="")
        return 0
    from gateway.control.preflight import engine_warnings, preflight

    try:
        if args.command == "check-config":
            settings = load_config(args.config)
            preflight(settings)
            for warning in [*settings.deprecations(), *engine_warnings(settings)]:
                print(f"kvgate: warning: {warning}", file=sys.stderr)
            print(f"{args.config}: ok ({len(settings.pools)} pools, {len(settings.routes)} routes)")
            return 0
        if args.command == "launch":
            from gateway.fleet.launcher import dry_run

            settings = _load(args.config)
            preflight(settings)
            for warning in engine_warnings(settings):
                print(f"kvgate: warning: {warning}", file=sys.stderr)
            print(dry_run(settings))
            return 0
        settings = _load(args.config)
        preflight(settings)
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        # `serve`'s flags are the data plane's address, `epp`'s the endpoint picker's.
        section = "epp" if args.command == "epp" else "server"
        if overrides:
            changed = getattr(settings, section).model_copy(update=overrides)
            settings = settings.model_copy(update={section: changed})
        if section == "epp":
            _epp_installed()
    except ConfigError as exc:
        print(f"kvgate: config error: {exc}", file=sys.stderr)
        return 2
    from gateway.logs import configure_logging
    from gateway.server import run

    configure_logging(settings.server.log_level, settings.server.log_json)
    server_overrides = overrides if section == "server" else {}
    return run(settings, str(args.config or default_config_path()), server_overrides, epp=section == "epp")


def _epp_installed() -> None:
    """EPP mode's gRPC packages are an extra: say which, rather than fail on an import."""
    try:
        import grpc  # noqa: F401
        import grpc_health.v1  # noqa: F401
        from google.protobuf import runtime_version  # noqa: F401  # protobuf 5.26+, as the extra asks
    except ImportError as exc:
        raise ConfigError(f"kvgate epp needs {exc.name}: pip install 'kvgate[epp]'") from None
