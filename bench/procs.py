"""Child processes of a benchmark: a simulated fleet and a gateway, started and always stopped.

Each child runs in its own process group, so stopping it (SIGTERM, then SIGKILL after a grace
period) also stops anything it spawned. Readiness is polled with a deadline; a child that exits
or never gets ready raises ProcessError with the tail of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from gateway.fleet.ports import port_is_free

HOST = "127.0.0.1"


class ProcessError(RuntimeError):
    """A child process failed to start or to become ready."""


def free_port_range(n: int, host: str = HOST, attempts: int = 200) -> int:
    """A base port such that base..base+n-1 are all free right now."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 60000 - n)
        if all(port_is_free(host, base + i) for i in range(n)):
            return base
    raise ProcessError(f"found no {n} consecutive free ports on {host}")


class Child:
    """One child process in its own session, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(self.env or {})},
            )
        return self

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, urls: Sequence[str], timeout_s: float) -> None:
        """Poll every URL until it answers 200; fail early if the process exits."""
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            if self.proc is not None and self.proc.poll() is not None:
                raise ProcessError(
                    f"{self.name} exited with code {self.proc.returncode} before it was ready "
                    f"({' '.join(self.argv)}); log {self.log_path}:\n{self.log_tail()}"
                )
            if _answers_200(pending[0]):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"{self.name} not ready after {timeout_s:g} s ({pending[0]} never answered 200); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def stop(self, grace_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        finally:
            # Stragglers the child left in its group (it has exited already).
            _signal_group(proc.pid, signal.SIGKILL)

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def source_trees(compare: str | None) -> dict[str, dict[str, str] | None]:
    """The gateways a side-by-side benchmark runs: this tree, and with `compare` (a directory, e.g.
    `git archive <rev> | tar -x -C DIR`) another, by name, each with the environment that makes
    `python -m gateway` import it (PYTHONSAFEPATH: the working directory must not shadow it)."""
    trees: dict[str, dict[str, str] | None] = {"this tree": None}
    if compare:
        tree = str(Path(compare).resolve())
        trees[f"compare ({tree})"] = {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}
    return trees


def write_report(out: Path, stem: str, data: dict[str, object], table: str) -> None:
    """`<stem>.json` and `<stem>.md` under `out`, the table printed with the load average."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"load": os.getloadavg(), **data}, indent=2))
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)
    print(f"\nload average {os.getloadavg()[0]:.2f}; written to {out}/")


def raise_keyboard_interrupt_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so every `finally` stops its children."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def listener_pids(port: int) -> list[int]:
    """The processes holding a listening TCP socket on `port` (Linux: /proc), for engines this
    tool did not start."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                    inodes.add(cols[9])
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(
                os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").rstrip("]") in inodes
                for fd in fds
            ):
                pids.append(int(pid))
    return pids


def signal_listener(port: int, sig: signal.Signals) -> None:
    """Send `sig` to the engine listening on `port` (kill -9 of an engine we did not start)."""
    pids = listener_pids(port)
    if not pids:
        raise ProcessError(f"no process of this user listens on port {port}")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
