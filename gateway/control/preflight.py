"""Everything `serve` resolves beyond the settings' own validation, checked before it starts.

`load_config` validates the settings' shape. Serving also resolves references: each pool's
routing policy (entry point or `module:Class`) and its
`args`, canonicalize rules, an explicitly named tokenizer, a managed fleet's command lines, and
the optional packages a feature needs (precise mode's ZMQ and msgpack). `preflight` does all of
that exactly as the runtime will, so that `kvgate check-config` fails where `kvgate serve` would,
and both fail with one line (`ConfigError`) instead of a traceback.

What may differ on the host that serves is a warning, not a failure (`engine_warnings`): a managed
fleet's engine command that cannot start here (not installed, not on PATH). The launcher refuses
to start it, with the same words.
"""

from __future__ import annotations

import importlib.util

from gateway.config import ConfigError, PoolConfig, Settings
from gateway.fleet.engines import adapter_for_spec
from gateway.fleet.engines.base import ReplicaSlot
from gateway.fleet.launcher import command_problem
from gateway.fleet.replica import Role
from gateway.prompt.canonicalize import compile_rules
from gateway.prompt.tokens import TokenizerError
from gateway.routing.policy import PolicyLoadError, load_policy
from gateway.routing.pool_router import pool_tokenizer


def preflight(settings: Settings) -> None:
    """Raise ConfigError naming the first reference that `serve` could not resolve."""
    for i, pool in enumerate(settings.pools):
        where = f"pools.{i} ({pool.name})"
        try:
            load_policy(pool.policy.type, pool.policy.args)
        except PolicyLoadError as exc:
            raise ConfigError(f"{where}.policy: {exc}") from None
        try:
            compile_rules(pool.canonicalize)
        except ValueError as exc:
            raise ConfigError(f"{where}.canonicalize: {exc}") from None
        try:
            pool_tokenizer(pool)
        except TokenizerError as exc:
            raise ConfigError(f"{where}.tokenizer: {exc}") from None
        if pool.prefix.mode == "precise":
            missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
            if missing:
                needs = " and ".join(missing)
                raise ConfigError(
                    f"{where}.prefix.mode precise needs {needs}: pip install 'kvgate[kvevents]'"
                )
        if pool.engines is not None:
            _commands(where, pool)


def engine_warnings(settings: Settings) -> list[str]:
    """One line per managed pool whose engine command cannot start on this host (after `preflight`)."""
    out = []
    for i, pool in enumerate(settings.pools):
        if pool.engines is None:
            continue
        argv, env = _commands(f"pools.{i} ({pool.name})", pool)[0]  # every role runs one executable
        problem = command_problem(argv, env, pool.engines.kind)
        if problem is not None:
            out.append(f"pools.{i} ({pool.name}).engines: {problem}")
    return out


def _commands(where: str, pool: PoolConfig) -> list[tuple[list[str], dict[str, str]]]:
    """One replica's command line and environment per role, built as the launcher builds them
    (without reserving ports)."""
    spec = pool.engines
    assert spec is not None
    adapter = adapter_for_spec(spec)
    roles: list[Role] = ["mixed"] if spec.roles is None else ["prefill", "decode"]
    out = []
    for role in roles:
        aux = dict.fromkeys(adapter.aux_port_names(spec, role), 1)
        slot = ReplicaSlot(0, f"{pool.name}-0", role, spec.host, 1, aux_ports=aux, kv_events=spec.kv_events)
        try:
            out.append(adapter.command(spec, spec.model or pool.model, slot, pool.served_model or pool.model))
        except ValueError as exc:
            raise ConfigError(f"{where}.engines: {exc}") from None
    return out
