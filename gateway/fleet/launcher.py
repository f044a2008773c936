"""Launches and supervises a pool's engine replicas (the managed fleet of an `EngineSpec`).

Each replica is one process in its own process group, logging to `<log_dir>/<name>.log`.
A replica is announced (`on_ready`) only once its health endpoint answers 200; when its process
exits it is withdrawn (`on_down`), the log tail goes to the gateway log, and it is restarted on
the same ports with exponential backoff. `stop()` terminates each process group (SIGTERM, then
SIGKILL after `stop_grace_s`). On Linux every engine also gets PR_SET_PDEATHSIG (SIGTERM, so it
can stop its own workers), so the engines die with the gateway even if it is killed without a
chance to stop them. The signal follows the thread that spawned the engine: run the launcher on
the thread that lives as long as the gateway (the event loop's).

`start()` returns at once: the gateway serves while engines load (minutes for a real model), and
replicas join the pool as they become ready. `wait_ready()` is for callers that want to block.

A command that cannot start at all (its executable not on PATH or not there, or the module a
`python -m` command runs not importable) is not retried: the replica is `failed`, with an error
naming the command and the setting to change (`engines.command`), logged once. Retrying could not
help: the gateway's PATH and the command are fixed at start. `command_problem` is that check, which
`kvgate check-config` runs too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import inspect
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp

from gateway.config import EngineSpec, Settings, parse_target
from gateway.fleet.engines import adapter_for_spec
from gateway.fleet.engines.base import (
    BOOTSTRAP_PORT,
    EngineAdapter,
    ReplicaSlot,
    connect_host,
    prepare_ipc_endpoint,
)
from gateway.fleet.ports import release_ports, reserve_free_port, reserve_port
from gateway.fleet.replica import Role

log = logging.getLogger("kvgate.launcher")

LOG_TAIL_LINES = 20
# Engines without a base port take theirs from the gateway's port plus this (8000: 8100 upwards).
ENGINE_PORT_OFFSET = 100
LOG_ROTATE_BYTES = 64 * 1024 * 1024
PROGRESS_EVERY_S = 10.0

ReadyCallback = Callable[["LaunchedReplica"], Awaitable[None] | None]
DownCallback = Callable[[str], Awaitable[None] | None]
ReplicaState = Literal["idle", "starting", "ready", "backoff", "stopped", "failed"]
# What to do about an engine that is not installed, by kind (`engines.command` is always the other way).
_INSTALL = {"vllm": "install vLLM", "sglang": "install SGLang"}
_MODULE_CHECK = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"


class LaunchError(Exception):
    """A fleet that did not come up; the message carries each failed replica's log tail."""


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Exactly how one replica is started."""

    name: str
    role: Role
    kind: str
    url: str
    port: int
    argv: list[str]
    env: dict[str, str]  # set on top of the gateway's own environment
    log_path: Path
    bootstrap_port: int | None = None
    kv_events_endpoint: str | None = None
    ports: tuple[int, ...] = ()  # every port reserved for the replica, HTTP first
    device: str | None = None  # the GPUs it shares with other replicas of the pool, if any

    def shell(self) -> str:
        """The command as one shell line, environment first, quoted for copy and paste."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}" if env else shlex.join(self.argv)


@dataclass(frozen=True, slots=True)
class LaunchedReplica:
    """A replica that answers its health check, ready to join the pool."""

    name: str
    url: str
    role: Role
    kind: str
    bootstrap_port: int | None
    pid: int
    kv_events_endpoint: str | None = None
    device: str | None = None
    kv_side_channel_host: str | None = None  # what it names as its KV's host, as the launcher set it
    kv_side_channel_ports: range | None = None  # and the ports its KV is served on, where it set them


@dataclass(slots=True)
class ReplicaStatus:
    name: str
    state: ReplicaState = "idle"
    pid: int | None = None
    restarts: int = 0
    failures: int = 0  # failed starts and early crashes in a row: the backoff exponent
    ready_since: float | None = None  # time.monotonic() when last announced
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class PortPlan:
    """Where engines without an `engines.base_port` get their ports: the first free ones from
    `start` upwards, pool after pool, never one of `avoid`; without a start (a gateway on port 0),
    ports the system picks. From a config, the same every time while those ports are free, so that
    `kvgate launch --dry-run` shows the ports `kvgate serve` will use."""

    start: int | None = None
    avoid: frozenset[int] = frozenset()

    @classmethod
    def for_settings(cls, settings: Settings) -> PortPlan:
        """From `server.port + ENGINE_PORT_OFFSET`, avoiding the gateway's listeners and every
        port an endpoint of the config names."""
        avoid = {settings.server.port, settings.control.port}
        avoid.update(parse_target(ep.url).port for pool in settings.pools for ep in pool.endpoints)
        start = settings.server.port + ENGINE_PORT_OFFSET if settings.server.port else None
        return cls(start, frozenset(avoid))


def plan_fleet(
    pool_name: str,
    spec: EngineSpec,
    model: str,
    served_model_name: str | None = None,
    ports: PortPlan = PortPlan(),
) -> list[LaunchPlan]:
    """Roles, GPUs, ports and command lines for every replica. Reserves the ports it picks
    (`gateway.fleet.ports`); whoever discards the plans should `release_ports` them."""
    adapter = adapter_for_spec(spec)
    roles: list[Role] = ["mixed"] * spec.replicas
    if spec.roles is not None:
        roles = ["prefill"] * spec.roles.prefill
        roles += ["decode"] * spec.roles.decode
    gpus = _gpu_assignment(spec, adapter)
    users: dict[int, int] = {}
    for ids in gpus:
        for gpu in ids or ():
            users[gpu] = users.get(gpu, 0) + 1
    reserved: list[int] = []
    try:
        http_ports: list[int] = []
        # With a start the auxiliary ports follow the HTTP ones, so a dry run is repeatable.
        next_port = spec.base_port or ports.start
        for i in range(spec.replicas):
            if spec.base_port:
                http_ports.append(reserve_port(spec.host, spec.base_port + i))
            else:
                http_ports.append(reserve_free_port(spec.host, next_port, avoid=ports.avoid))
                next_port = http_ports[-1] + 1 if next_port is not None else None
            reserved.append(http_ports[-1])
        next_aux = spec.base_port + spec.replicas if spec.base_port else next_port
        plans: list[LaunchPlan] = []
        for i, role in enumerate(roles):
            aux: dict[str, int] = {}
            first_reserved = len(reserved)
            for aux_name in adapter.aux_port_names(spec, role):
                span = adapter.aux_port_span(spec, aux_name)
                aux[aux_name] = reserve_free_port(spec.host, next_aux, span, ports.avoid)
                reserved += range(aux[aux_name], aux[aux_name] + span)
                if next_aux is not None:
                    next_aux = aux[aux_name] + span
            ids = gpus[i]
            slot = ReplicaSlot(
                index=i,
                name=f"{pool_name}-{i}",
                role=role,
                host=spec.host,
                port=http_ports[i],
                gpu_ids=ids,
                gpu_sharers=max((users[g] for g in ids), default=1) if ids else 1,
                aux_ports=aux,
                kv_events=spec.kv_events,
            )
            argv, env = adapter.command(spec, model, slot, served_model_name)
            plans.append(
                LaunchPlan(
                    name=slot.name,
                    role=role,
                    kind=adapter.kind,
                    url=f"http://{connect_host(spec.host)}:{slot.port}",
                    port=slot.port,
                    argv=argv,
                    env=env,
                    log_path=Path(spec.log_dir) / f"{slot.name}.log",
                    bootstrap_port=aux.get(BOOTSTRAP_PORT),
                    kv_events_endpoint=slot.kv_events_endpoint,
                    ports=(slot.port, *reserved[first_reserved:]),
                    device=shared_device(ids, slot.gpu_sharers),
                )
            )
    except BaseException:
        release_ports(reserved)
        raise
    return plans


def shared_device(gpu_ids: tuple[int, ...] | None, sharers: int) -> str | None:
    """The device key of replicas placed on the same GPUs (`gpu:0`, `gpu:2,3`), None for a replica
    with its GPUs to itself: only sharing changes what load on one replica costs the others."""
    if not gpu_ids or sharers <= 1:
        return None
    return "gpu:" + ",".join(str(g) for g in gpu_ids)


def _gpu_assignment(spec: EngineSpec, adapter: EngineAdapter) -> list[tuple[int, ...] | None]:
    if spec.gpu_ids is not None:  # a simulator given a layout models its sharing (SimAdapter)
        return [tuple(ids) for ids in spec.gpu_ids]
    if not adapter.uses_gpus:
        return [None] * spec.replicas
    # Without an explicit layout each replica gets its own GPUs: left alone, every engine would
    # land on GPU 0 and claim most of its memory.
    tp = spec.tensor_parallel_size
    return [tuple(range(i * tp, (i + 1) * tp)) for i in range(spec.replicas)]


def dry_run(settings: Settings) -> str:
    """Every managed pool's command lines, for review before `kvgate launch`: planned as `serve`
    plans them (pool after pool, each keeping its ports until the last is planned)."""
    out: list[str] = []
    planned: list[int] = []
    ports = PortPlan.for_settings(settings)
    try:
        for pool in settings.pools:
            spec = pool.engines
            if spec is None:
                continue
            model = spec.model or pool.model
            plans = plan_fleet(pool.name, spec, model, pool.served_model or pool.model, ports)
            planned += [p for plan in plans for p in plan.ports]
            split = f" (prefill {spec.roles.prefill}, decode {spec.roles.decode})" if spec.roles else ""
            out.append(f"# pool {pool.name}: {spec.replicas} x {spec.kind}{split}, model {model}")
            for plan in plans:
                extra = f" bootstrap_port={plan.bootstrap_port}" if plan.bootstrap_port else ""
                if plan.kv_events_endpoint:
                    extra += f" kv_events={plan.kv_events_endpoint}"
                if plan.device:
                    extra += f" device={plan.device}"
                out.append(f"# {plan.name} role={plan.role} url={plan.url} log={plan.log_path}{extra}")
                out.append(plan.shell())
            out.append("")
    finally:
        release_ports(planned)
    return "\n".join(out) if out else "# no managed pools (no `engines:` section in any pool)\n"


def command_problem(argv: list[str], engine_env: dict[str, str], kind: str) -> str | None:
    """Why an engine's command (with the environment set on top of the gateway's) cannot start, in
    words that say what to set; None when it can, as far as can be told without starting it: its
    executable exists, and a `python -m` command's package is found by that interpreter."""
    exe, env = argv[0], {**os.environ, **engine_env}
    fix = "set engines.command" + (f" or {_INSTALL[kind]}" if kind in _INSTALL else "")
    if os.sep in exe:
        if not os.path.isfile(exe):
            return f"`{exe}` does not exist: {fix}"
        if not os.access(exe, os.X_OK):
            return f"`{exe}` is not executable: {fix}"
        found = exe
    else:
        which = shutil.which(exe, path=env.get("PATH", os.defpath))
        if which is None:
            return f"`{exe}` not found on PATH: {fix}"
        found = which
    if len(argv) > 2 and argv[1] == "-m":
        package = argv[2].split(".")[0]
        if os.path.abspath(found) == os.path.abspath(sys.executable) and "PYTHONPATH" not in engine_env:
            importable = importlib.util.find_spec(package) is not None  # this interpreter: ask itself
        else:
            importable = _importable(found, package, env)
        if not importable:
            return f"`{exe}` cannot import {package} (for `-m {argv[2]}`): {fix}"
    return None


def _importable(python: str, package: str, env: dict[str, str]) -> bool:
    """Whether another interpreter finds `package` (locating a top-level package imports nothing).
    One that cannot say counts as finding it: the start then fails, or not, on its own terms."""
    try:
        done = subprocess.run(
            [python, "-c", _MODULE_CHECK, package], env=env, capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return done.returncode != 1


def _load_prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        if _prctl is not None:
            # SIGTERM rather than SIGKILL: the engine then stops its own worker processes.
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the gateway died before prctl took effect
            os._exit(1)

    return preexec


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read()
    except OSError:
        return "(no log)"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


async def _call(callback: Callable[..., Awaitable[None] | None], arg: object) -> None:
    try:
        result = callback(arg)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("launcher callback %s failed", getattr(callback, "__name__", callback))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@dataclass(slots=True)
class _Replica:
    plan: LaunchPlan
    status: ReplicaStatus
    proc: asyncio.subprocess.Process | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class FleetLauncher:
    """Starts, watches and restarts one pool's replicas."""

    def __init__(
        self,
        pool_name: str,
        spec: EngineSpec,
        model: str,
        on_ready: ReadyCallback,
        on_down: DownCallback,
        *,
        served_model_name: str | None = None,
        ports: PortPlan = PortPlan(),
        health_poll_s: float = 0.25,
        progress_every_s: float = PROGRESS_EVERY_S,
    ) -> None:
        self.pool_name = pool_name
        self.spec = spec
        self.model = model
        self.served_model_name = served_model_name
        self._ports = ports
        self._on_ready = on_ready
        self._on_down = on_down
        self._health_poll_s = health_poll_s
        self._progress_every_s = progress_every_s
        self._plans: list[LaunchPlan] | None = None
        self._replicas: dict[str, _Replica] = {}
        self._stopping = False
        self._stop_event = asyncio.Event()
        self._changed = asyncio.Condition()
        self._client: aiohttp.ClientSession | None = None

    def command_lines(self) -> list[LaunchPlan]:
        """The launch plan of every replica (ports are chosen, and kept, on the first call)."""
        if self._plans is None:
            self._plans = plan_fleet(
                self.pool_name, self.spec, self.model, self.served_model_name, self._ports
            )
        return list(self._plans)

    def status(self) -> dict[str, ReplicaStatus]:
        return {name: r.status for name, r in self._replicas.items()}

    async def start(self) -> None:
        """Spawn every replica and return; each is announced through `on_ready` when healthy."""
        if self._replicas:
            raise RuntimeError("launcher already started")
        plans = self.command_lines()
        # trust_env=False: a proxy from the environment must not sit between us and loopback.
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0), trust_env=False)
        for plan in plans:
            replica = _Replica(plan, ReplicaStatus(plan.name))
            self._replicas[plan.name] = replica
            replica.task = asyncio.create_task(self._supervise(replica), name=f"supervise {plan.name}")

    async def wait_ready(
        self, timeout_s: float | None = None, fail_fast: bool = True
    ) -> list[LaunchedReplica]:
        """Block until every replica is ready; LaunchError (with log tails) on timeout, or at the
        first failed start when `fail_fast`."""
        timeout = self.spec.startup_timeout_s if timeout_s is None else timeout_s

        def settled() -> bool:
            states = self._replicas.values()
            return all(r.status.state == "ready" for r in states) or (
                fail_fast and any(r.status.state != "ready" and r.status.last_error for r in states)
            )

        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(settled), timeout)
        except TimeoutError:
            pass
        problems = [
            f"{r.plan.name}: {r.status.last_error or f'not ready after {timeout:g} s'}"
            for r in self._replicas.values()
            if r.status.state != "ready"
        ]
        if problems:
            raise LaunchError("\n".join(problems))
        return [self._launched(r) for r in self._replicas.values()]

    async def stop(self) -> None:
        """Stop supervising, then terminate every replica's process group."""
        self._stopping = True
        self._stop_event.set()
        tasks = [r.task for r in self._replicas.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(self._terminate(r) for r in self._replicas.values()))
        for replica in self._replicas.values():
            replica.status.state = "stopped"
            endpoint = replica.plan.kv_events_endpoint
            if endpoint is not None and endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):  # the engine leaves its socket file behind
                    os.unlink(endpoint.removeprefix("ipc://"))
        if self._client is not None:
            await self._client.close()
        if self._plans is not None:
            release_ports([p for plan in self._plans for p in plan.ports])

    def _launched(self, replica: _Replica) -> LaunchedReplica:
        plan = replica.plan
        assert replica.proc is not None
        return LaunchedReplica(
            name=plan.name,
            url=plan.url,
            role=plan.role,
            kind=plan.kind,
            bootstrap_port=plan.bootstrap_port,
            pid=replica.proc.pid,
            kv_events_endpoint=plan.kv_events_endpoint,
            device=plan.device,
            kv_side_channel_host=plan.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST"),
            kv_side_channel_ports=_side_channel_ports(plan.env, self.spec.tensor_parallel_size),
        )

    async def _set_state(self, replica: _Replica, state: ReplicaState) -> None:
        replica.status.state = state
        async with self._changed:
            self._changed.notify_all()

    async def _supervise(self, replica: _Replica) -> None:
        name, status = replica.plan.name, replica.status
        while not self._stopping:
            await self._set_state(replica, "starting")
            plan = replica.plan
            problem = await asyncio.to_thread(command_problem, plan.argv, plan.env, plan.kind)
            if problem is not None:
                status.last_error = f"replica {name} cannot be started: {problem}"
                log.error("%s; not retried (fix it, then restart the gateway)", status.last_error)
                await self._set_state(replica, "failed")
                return
            try:
                error = await self._run_once(replica)
            except OSError as exc:  # the executable is missing, the log dir unwritable...
                error = f"could not be started: {exc}"
            if self._stopping:
                return
            if status.ready_since is not None and time.monotonic() - status.ready_since >= (
                self.spec.restart_backoff_max_s
            ):
                status.failures = 0  # it ran for a good while: this crash starts a new series
            status.ready_since = None
            status.failures += 1
            headline = f"replica {name} {error}; last {LOG_TAIL_LINES} lines of {replica.plan.log_path}:"
            tail = read_log_tail(replica.plan.log_path)
            status.last_error = f"{headline}\n{tail}"
            log.error("%s", headline, extra={"block": tail})
            delay = min(
                self.spec.restart_backoff_max_s, self.spec.restart_backoff_s * 2 ** (status.failures - 1)
            )
            await self._set_state(replica, "backoff")
            log.info("restarting replica %s in %.2f s", name, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), delay)
            status.restarts += 1

    async def _run_once(self, replica: _Replica) -> str:
        """Start the process, announce it when healthy, and return why it ended."""
        plan = replica.plan
        proc = await self._spawn(replica)
        exited = asyncio.ensure_future(proc.wait())
        try:
            error = await self._wait_healthy(plan, proc, exited)
            if error is not None:
                await self._terminate(replica)
                return error
            log.info("replica %s ready at %s (pid %d)", plan.name, plan.url, proc.pid)
            # Announce first: when wait_ready() returns, the pool already knows every replica.
            await _call(self._on_ready, self._launched(replica))
            replica.status.last_error = None
            replica.status.ready_since = time.monotonic()
            await self._set_state(replica, "ready")
            code = await exited
        finally:
            exited.cancel()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever the engine left behind in its group
        if self._stopping:
            return "stopped"
        await _call(self._on_down, plan.name)
        return f"exited with code {code}"

    async def _spawn(self, replica: _Replica) -> asyncio.subprocess.Process:
        plan = replica.plan
        plan.log_path.parent.mkdir(parents=True, exist_ok=True)
        prepare_ipc_endpoint(plan.kv_events_endpoint)
        with contextlib.suppress(FileNotFoundError):
            if plan.log_path.stat().st_size > LOG_ROTATE_BYTES:  # keep one previous log, not all
                plan.log_path.replace(plan.log_path.with_name(plan.log_path.name + ".1"))
        with plan.log_path.open("ab") as logfile:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logfile.write(f"=== {stamp} kvgate starting {plan.name}: {plan.shell()}\n".encode())
            logfile.flush()
            proc = await asyncio.create_subprocess_exec(
                *plan.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logfile,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **plan.env},
                start_new_session=True,  # own process group: stop() signals the engine's children too
                preexec_fn=_die_with_parent(os.getpid()),
            )
        replica.proc = proc
        replica.status.pid = proc.pid
        log.info("replica %s started (pid %d), log %s", plan.name, proc.pid, plan.log_path)
        return proc

    async def _wait_healthy(
        self, plan: LaunchPlan, proc: asyncio.subprocess.Process, exited: asyncio.Future[int]
    ) -> str | None:
        assert self._client is not None
        health_url = plan.url + adapter_for_spec(self.spec).health_path
        started = time.monotonic()
        next_progress = started + self._progress_every_s
        while True:
            if exited.done():
                return f"exited with code {exited.result()} while starting"
            try:
                async with self._client.get(health_url) as response:
                    if response.status == 200:
                        return None
            except (aiohttp.ClientError, TimeoutError):
                pass  # not listening yet
            now = time.monotonic()
            if now - started >= self.spec.startup_timeout_s:
                return f"not ready after {self.spec.startup_timeout_s:g} s (startup_timeout_s)"
            if now >= next_progress:
                log.info("replica %s still starting (%.0f s)", plan.name, now - started)
                next_progress += self._progress_every_s
            await asyncio.wait({exited}, timeout=self._health_poll_s)

    async def _terminate(self, replica: _Replica) -> None:
        proc = replica.proc
        if proc is None:
            return
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.spec.stop_grace_s)
            except TimeoutError:
                log.warning(
                    "replica %s ignored SIGTERM for %g s: SIGKILL", replica.plan.name, self.spec.stop_grace_s
                )
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)


def _side_channel_ports(env: dict[str, str], ranks: int) -> range | None:
    """The NIXL side-channel ports the launcher gave a replica: its base port plus each worker's rank."""
    base = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    return range(int(base), int(base) + ranks) if base is not None and base.isdigit() else None
