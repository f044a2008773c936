"""`kvgate bench scenario faults`: faults under steady streaming load, and what each client got.

Four simulated replicas (one process each, so one can be killed alone), a private `redis-server`
on a free port for the gateway's shared state, and one gateway with JSON access logs. C clients
in a closed loop send streaming chats; the scenario's schedule kills (-9) and restarts an engine,
stops (SIGSTOP) and continues another, kills and restarts Redis, and makes clients drop their
streams after the first chunk for a while.

Every request ends in exactly one of:
- completed: the stream reached `data: [DONE]` with no error event;
- error: an HTTP error status, or an SSE error event in the stream (the client was told);
- abandoned: the client itself left after the first chunk (the disconnect fault);
- lost: none of these (the stream stopped without [DONE] or error, the connection broke, timeout).

Wrong-client check: each request carries its own X-Request-Id; the gateway's access log maps it to
the engine request id it made, and the simulator names every chunk `chatcmpl-<engine id>`, so a
completed stream whose chunks carry any other id reached the wrong client.

Traffic timing: /metrics is read every 0.1 s; `kvgate_replica_requests_total` (upstream attempts
per replica) says when attempts to a killed or stopped replica stop (after the fault) and resume
(after the replica answers /health again, or after SIGCONT). Figures are within 0.1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench import procs, seams, text
from bench.loadgen import run_sync
from bench.scenario import BASE_GATEWAY_CONFIG, POOL_NAME, FleetSpec, deep_merge

ACTIONS = ("kill", "restart", "stop", "cont", "kill_redis", "restart_redis", "disconnect_clients")
REPLICA_ACTIONS = ("kill", "restart", "stop", "cont")
OUTCOMES = ("completed", "error", "abandoned", "lost")
_ATTEMPTS = re.compile(r'^kvgate_replica_requests_total\{[^}]*replica="([^"]+)"[^}]*\} ([0-9.e+]+)$', re.M)
_INFLIGHT = re.compile(r"^kvgate_replica_inflight_requests\{[^}]*\} ([0-9.e+]+)$", re.M)


@dataclass
class FaultStep:
    at: float
    action: str
    replica: int | None = None
    for_s: float = 0.0  # disconnect_clients: how long clients keep dropping streams
    fraction: float = 0.0  # disconnect_clients: the share of requests dropped meanwhile


@dataclass
class FaultSize:
    duration_s: float
    faults: list[FaultStep]


@dataclass
class FaultLoad:
    concurrency: int = 8
    max_tokens: int = 32
    groups: int = 8
    system_tokens: int = 512
    question_tokens: int = 32


@dataclass
class FaultScenario:
    name: str
    sizes: dict[str, FaultSize]
    description: str = ""
    kind: str = "faults"
    fleet: FleetSpec = field(default_factory=FleetSpec)
    gateway: dict[str, Any] = field(default_factory=dict)
    load: FaultLoad = field(default_factory=FaultLoad)
    seed: int = 0
    # Named gateway configs (deep-merged over `gateway`), the schedule run once under each: e.g.
    # failover off and on, side by side. Empty: one run as `gateway` says.
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)

    def size(self, name: str) -> FaultSize:
        try:
            return self.sizes[name]
        except KeyError:
            raise ValueError(f"scenario {self.name!r} has no size {name!r}: {sorted(self.sizes)}") from None


def fault_scenario_from_dict(data: dict[str, Any]) -> FaultScenario:
    data = dict(data)
    try:
        data["fleet"] = FleetSpec(**(data.get("fleet") or {}))
        data["load"] = FaultLoad(**(data.get("load") or {}))
        data["sizes"] = {
            k: FaultSize(v["duration_s"], [FaultStep(**f) for f in v.get("faults") or []])
            for k, v in (data.get("sizes") or {}).items()
        }
        scenario = FaultScenario(**data)
    except (TypeError, KeyError) as exc:
        raise ValueError(f"scenario {data.get('name')!r}: {exc}") from None
    for size_name, size in scenario.sizes.items():
        for step in size.faults:
            where = f"scenario {scenario.name!r} size {size_name!r} at {step.at}"
            if step.action not in ACTIONS:
                raise ValueError(f"{where}: unknown action {step.action!r}; one of {ACTIONS}")
            if step.action in REPLICA_ACTIONS and not (
                step.replica is not None and 0 <= step.replica < scenario.fleet.replicas
            ):
                raise ValueError(f"{where}: {step.action} needs replica 0..{scenario.fleet.replicas - 1}")
            if not 0 <= step.at < size.duration_s:
                raise ValueError(f"{where}: outside the run (duration_s {size.duration_s})")
    return scenario


@dataclass
class Outcome:
    marker: str
    sent: float
    ended: float = 0.0
    outcome: str = "lost"
    status: int = 0
    replica: str | None = None
    chunk_id: str | None = None
    detail: str | None = None
    body: dict[str, Any] | None = None
    text: str = ""  # the answer's text as the client read it
    chunk_times: list[float] = field(default_factory=list)  # when each content chunk arrived


class Run:
    """The processes of one run and the clock every event is stamped with."""

    def __init__(
        self,
        scenario: FaultScenario,
        out_dir: Path,
        endpoints: list[str] | None = None,
        engine_kind: str = "vllm",
    ) -> None:
        self.scenario = scenario
        self.out_dir = out_dir
        self.logs = out_dir / "logs"
        self.t0 = time.monotonic()
        # Existing engines (`--endpoints`): signalled through the process that listens on each
        # URL's port; they cannot be restarted from here.
        self.endpoints = endpoints
        self.engine_kind = engine_kind
        n = len(endpoints) if endpoints else scenario.fleet.replicas
        base = procs.free_port_range(n + 2)
        self.replica_ports = [base + i for i in range(n)]
        if endpoints:
            self.replica_ports = [int(u.rstrip("/").rsplit(":", 1)[1]) for u in endpoints]
        self.redis_port, self.gateway_port = base + n, base + n + 1
        self.replicas: list[procs.Child | None] = [None] * n
        self.redis: procs.Child | None = None
        self.gateway: procs.Child | None = None
        self.events: list[dict[str, Any]] = []  # what was done, when
        self.dropping = 0.0  # share of new requests the clients drop (disconnect fault)
        self.identical: list[bool] = []  # per continued answer: its text was the uninterrupted one
        self.control: list[bool] = []  # the same for answers never continued (seams.control)

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def url(self) -> str:
        return f"http://{procs.HOST}:{self.gateway_port}"

    def replica_url(self, i: int) -> str:
        return (
            self.endpoints[i].rstrip("/")
            if self.endpoints
            else f"http://{procs.HOST}:{self.replica_ports[i]}"
        )

    @property
    def uses_redis(self) -> bool:
        state = deep_merge(yaml.safe_load(BASE_GATEWAY_CONFIG.read_text()) or {}, self.scenario.gateway)
        return (state.get("state") or {}).get("backend") == "redis"

    # -- processes ----------------------------------------------------------------------------
    def start_replica(self, i: int) -> procs.Child:
        f = self.scenario.fleet
        argv = procs.python_module(
            f.module, "--model", f.model, "--port", str(self.replica_ports[i]),
            "--profile", f.profile, "--speedup", str(f.speedup), *f.args,
        )  # fmt: skip
        child = procs.Child(f"replica r{i}", argv, self.logs / f"r{i}.log").start()
        self.replicas[i] = child
        return child

    def start_redis(self) -> procs.Child:
        argv = ["redis-server", "--port", str(self.redis_port), "--bind", procs.HOST, "--save", ""]
        argv += ["--appendonly", "no"]
        self.redis = procs.Child("redis", argv, self.logs / "redis.log").start()
        return self.redis

    def gateway_config(self) -> dict[str, Any]:
        base = yaml.safe_load(BASE_GATEWAY_CONFIG.read_text()) or {}
        merged = deep_merge(base, self.scenario.gateway)
        own: dict[str, Any] = {
            "server": {"host": procs.HOST, "port": self.gateway_port, "access_log": True, "log_json": True}
        }
        if self.uses_redis:
            own["state"] = {
                "redis_url": f"redis://{procs.HOST}:{self.redis_port}/0",
                "key_prefix": f"kvgate-faults-{uuid.uuid4().hex[:12]}",
            }
        merged = deep_merge(merged, own)
        merged["server"]["log_level"] = "info"
        kind = self.engine_kind if self.endpoints else "sim"
        endpoints = [
            {"url": self.replica_url(i), "name": f"r{i}", "kind": kind} for i in range(len(self.replicas))
        ]
        pool = {"name": POOL_NAME, "model": self.scenario.fleet.model, "endpoints": endpoints}
        merged["pools"] = [deep_merge(pool, merged.pop("pool", {}) or {})]
        return merged

    def start(self) -> None:
        timeout = self.scenario.fleet.startup_timeout_s
        if self.uses_redis:
            self.start_redis()
            _wait_port(self.redis_port, timeout)
        if not self.endpoints:
            for i in range(len(self.replicas)):
                self.start_replica(i)
            for i, child in enumerate(self.replicas):
                assert child is not None
                child.wait_ready([f"http://{procs.HOST}:{self.replica_ports[i]}/health"], timeout)
        cfg = self.out_dir / "gateway.yaml"
        cfg.write_text(yaml.safe_dump(self.gateway_config(), sort_keys=False))
        argv = procs.python_module("gateway", "serve", "--config", str(cfg))
        self.gateway = procs.Child("gateway", argv, self.logs / "gateway.log").start()
        self.gateway.wait_ready([self.url + "/ready"], timeout)

    def stop(self) -> None:
        for child in [self.gateway, *self.replicas, self.redis]:
            if child is not None:
                _signal(child, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                child.stop(grace_s=5)

    # -- faults -------------------------------------------------------------------------------
    async def apply(self, step: FaultStep) -> None:
        event: dict[str, Any] = {"at": round(self.now(), 3), **asdict(step)}
        self.events.append(event)
        if step.action in ("kill", "stop"):
            # A fault that hits no answer shows nothing: wait (a little) for the replica to hold
            # its share of the streams (closed-loop clients come in waves).
            share = self.scenario.load.concurrency // max(1, len(self.replicas)) // 2
            event["busy_wait_s"] = await self._busy(f"r{step.replica or 0}", max(1, share))
        if step.action in ("kill", "stop", "cont"):
            sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT}[step.action]
            if self.endpoints:
                procs.signal_listener(self.replica_ports[step.replica or 0], sig)
            else:
                child = self.replicas[step.replica or 0]
                assert child is not None
                _signal(child, sig)
            if step.action == "cont":
                event["ready_at"] = event["at"]
        elif step.action == "restart":
            if self.endpoints:
                raise ValueError("existing engines (--endpoints) cannot be restarted by the scenario")
            i = step.replica or 0
            old = self.replicas[i]
            if old is not None:
                old.stop(grace_s=1)
            self.start_replica(i)
            event["ready_at"] = await self._ready(f"http://{procs.HOST}:{self.replica_ports[i]}/health")
        elif step.action == "kill_redis":
            assert self.redis is not None
            _signal(self.redis, signal.SIGKILL)
        elif step.action == "restart_redis":
            assert self.redis is not None
            self.redis.stop(grace_s=1)
            self.start_redis()
        elif step.action == "disconnect_clients":
            self.dropping = step.fraction
            await asyncio.sleep(step.for_s)
            self.dropping = 0.0
            event["until"] = round(self.now(), 3)

    async def _busy(self, name: str, at_least: int, limit_s: float = 5.0) -> float:
        """Seconds waited until replica `name` had `at_least` requests in flight (at most `limit_s`)."""
        start = self.now()
        pattern = re.compile(
            rf'^kvgate_replica_inflight_requests{{[^}}]*replica="{name}"[^}}]*}} ([0-9.e+]+)$', re.M
        )
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
            while self.now() - start < limit_s:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with s.get(self.url + "/metrics") as r:
                        if any(float(v) >= at_least for v in pattern.findall(await r.text())):
                            break
                await asyncio.sleep(0.02)
        return round(self.now() - start, 3)

    async def _ready(self, url: str) -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with s.get(url) as r:
                        if r.status == 200:
                            return round(self.now(), 3)
                await asyncio.sleep(0.05)


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while procs.port_is_free(procs.HOST, port):
        if time.monotonic() > deadline:
            raise procs.ProcessError(f"nothing listens on port {port} after {timeout_s:g} s")
        time.sleep(0.05)


def _signal(child: procs.Child, sig: signal.Signals) -> None:
    if child.proc is not None and child.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, sig)


# -- the clients ------------------------------------------------------------------------------
def prompt(load: FaultLoad, seed: int, n: int) -> list[dict[str, str]]:
    """Request n's messages: one of `groups` shared system prompts and a question of its own."""
    group = n % load.groups
    system = text.words(f"faults:system:{seed}:{group}", load.system_tokens)
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": text.words(f"faults:q:{seed}:{n}", load.question_tokens)},
    ]


async def _client(run: Run, worker: int, stop: asyncio.Event, out: list[Outcome]) -> None:
    scenario = run.scenario
    rng = random.Random(f"faults:{scenario.seed}:{worker}")
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        n = 0
        while not stop.is_set():
            n += 1
            marker = f"fault-{worker}-{n}"
            drop = rng.random() < run.dropping
            rec = Outcome(marker, run.now())
            out.append(rec)
            body = {
                "model": scenario.fleet.model,
                "messages": prompt(scenario.load, scenario.seed, worker * 1_000_000 + n),
                "max_tokens": scenario.load.max_tokens,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,  # greedy: a continued answer can be checked token for token
            }
            rec.body = body
            await stream_chat(session, run.url, body, rec, drop, run.now)
            rec.ended = run.now()


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    rec: Outcome,
    drop: bool,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Send a streaming chat, read it to its end (or leave after the first chunk if `drop`), and
    fill in how it ended."""
    try:
        async with session.post(
            url + "/v1/chat/completions", data=orjson.dumps(body), headers={"x-request-id": rec.marker}
        ) as r:
            rec.status, rec.replica = r.status, r.headers.get("x-kvgate-replica")
            if r.status != 200:
                rec.outcome, rec.detail = "error", (await r.read())[:200].decode(errors="replace")
                return
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    rec.outcome = "completed"
                    return
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    rec.outcome, rec.detail = "error", str(chunk["error"].get("message"))[:200]
                    return
                rec.chunk_id = rec.chunk_id or chunk.get("id")
                for choice in chunk.get("choices") or ():
                    if content := (choice.get("delta") or {}).get("content"):
                        rec.text += content
                        rec.chunk_times.append(clock())
                if drop:
                    rec.outcome = "abandoned"
                    return  # leaving the block closes the connection mid-stream
            rec.detail = "stream ended without [DONE] or an error event"
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        rec.detail = f"{type(exc).__name__}: {exc}"[:200]


async def _sample_metrics(run: Run, samples: list[tuple[float, dict[str, float]]]) -> None:
    """Until cancelled: per-replica upstream attempts, every 0.1 s."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with s.get(run.url + "/metrics") as r:
                    textual = await r.text()
                samples.append((run.now(), {m[0]: float(m[1]) for m in _ATTEMPTS.findall(textual)}))
            await asyncio.sleep(0.1)


async def _inflight(url: str) -> float:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s,
        s.get(url + "/metrics") as r,
    ):
        return sum(float(v) for v in _INFLIGHT.findall(await r.text()))


async def _drive(
    run: Run, size: FaultSize
) -> tuple[list[Outcome], list[tuple[float, dict[str, float]]], float]:
    stop = asyncio.Event()
    outcomes: list[Outcome] = []
    samples: list[tuple[float, dict[str, float]]] = []
    sampler = asyncio.create_task(_sample_metrics(run, samples))
    clients = [
        asyncio.create_task(_client(run, w, stop, outcomes)) for w in range(run.scenario.load.concurrency)
    ]

    async def schedule() -> None:
        for step in sorted(size.faults, key=lambda s: s.at):
            await asyncio.sleep(max(0.0, step.at - run.now()))
            await run.apply(step)

    faults = asyncio.create_task(schedule())
    await asyncio.sleep(max(0.0, size.duration_s - run.now()))
    stop.set()
    await asyncio.wait_for(asyncio.gather(*clients, faults), 90)
    await asyncio.sleep(0.5)
    inflight = await _inflight(run.url)
    # While the fleet still serves: each continued answer against the same request uninterrupted.
    access = _access_log(run.gateway.log_path) if run.gateway is not None else {}
    continued = seams.resumed(outcomes, access)
    run.identical = await seams.replay(run.url, continued)
    run.control = await seams.replay(run.url, seams.control(outcomes, access, len(continued)))
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    return outcomes, samples, inflight


# -- the report -------------------------------------------------------------------------------
def _access_log(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"kvgate.access"' in line:
            doc = json.loads(line)
            out[doc["request_id"]] = doc
    return out


def _traffic(
    events: list[dict[str, Any]], samples: list[tuple[float, dict[str, float]]]
) -> list[dict[str, Any]]:
    """Per replica fault: seconds until attempts stopped, and until they resumed after its return."""
    rows = []
    for ev in events:
        if ev["action"] not in ("kill", "stop"):
            continue
        name = f"r{ev['replica']}"
        back = next(
            (
                e
                for e in events
                if e["at"] > ev["at"] and e["action"] in ("restart", "cont") and e["replica"] == ev["replica"]
            ),
            None,
        )
        ready = back.get("ready_at") if back else None
        increases = [
            t
            for (t, c), (_, prev) in zip(samples[1:], samples, strict=False)
            if c.get(name, 0) > prev.get(name, 0)
        ]
        during = [t for t in increases if ev["at"] < t and (ready is None or t < ready)]
        after = [t for t in increases if ready is not None and t >= ready]
        rows.append(
            {
                "fault": f"{ev['action']} {name}",
                "at_s": ev["at"],
                "off_after_s": round(max(during) - ev["at"], 2) if during else 0.0,
                "returned_at_s": ready,
                "back_after_s": round(after[0] - ready, 2) if after and ready is not None else None,
            }
        )
    return rows


def report(
    run: Run, outcomes: list[Outcome], samples: list[tuple[float, dict[str, float]]], inflight: float
) -> dict[str, Any]:
    assert run.gateway is not None
    access = _access_log(run.gateway.log_path)
    counts = {k: sum(o.outcome == k for o in outcomes) for k in OUTCOMES}
    wrong = [
        o.marker
        for o in outcomes
        if o.outcome == "completed"
        and o.chunk_id is not None
        and access.get(o.marker, {}).get("engine_request_id") is not None
        and o.chunk_id != "chatcmpl-" + access[o.marker]["engine_request_id"]
    ]
    unmatched = sum(o.outcome == "completed" and o.marker not in access for o in outcomes)
    checked = sum(
        o.outcome == "completed" and o.chunk_id is not None and o.marker in access for o in outcomes
    )
    gateway_499 = sum(1 for doc in access.values() if doc.get("status") == 499)
    return {
        "sent": len(outcomes),
        **counts,
        "wrong_client": len(wrong),
        "wrong_client_markers": wrong[:20],
        "wrong_client_checked": checked,
        "completed_without_access_log_line": unmatched,
        "gateway_counted_499": gateway_499,
        "inflight_at_end": inflight,
        "lost_examples": [asdict(o) for o in outcomes if o.outcome == "lost"][:10],
        "error_examples": sorted({o.detail or "" for o in outcomes if o.outcome == "error"})[:10],
        "traffic": _traffic(run.events, samples),
        "events": run.events,
        "phases": _phases(run.events, outcomes),
        "failover": seams.summary(outcomes, access, run.identical, run.control),
    }


def _phases(events: list[dict[str, Any]], outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Outcomes by the fault in force when each request was sent."""
    edges = [(0.0, "steady")] + [
        (e["at"], f"{e['action']}" + (f" r{e['replica']}" if e["replica"] is not None else ""))
        for e in events
    ]
    rows = []
    for i, (start, label) in enumerate(edges):
        end = edges[i + 1][0] if i + 1 < len(edges) else float("inf")
        sent = [o for o in outcomes if start <= o.sent < end]
        rows.append(
            {
                "from_s": start,
                "phase": label,
                "sent": len(sent),
                **{k: sum(o.outcome == k for o in sent) for k in OUTCOMES},
            }
        )
    return rows


def markdown(result: dict[str, Any], title: str, meta: dict[str, Any]) -> str:
    lines = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in meta.items()] + [""]
    lines += [
        "| sent | completed | error (told) | abandoned by client | lost (not told) | wrong client "
        "| gateway 499 | in flight at end |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| "
        + " | ".join(str(result[k]) for k in ("sent", *OUTCOMES, "wrong_client", "gateway_counted_499"))
        + f" | {result['inflight_at_end']:g} |",
        "",
        f"The wrong-client check compared {result['wrong_client_checked']} completed streams with the "
        "gateway's access log; gateway 499 counts the abandoned streams the gateway saw end early (the "
        "rest had been written to the end when the client left).",
        "",
        "| from (s) | while | sent | completed | error | abandoned | lost |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in result["phases"]:
        lines.append(
            f"| {p['from_s']:g} | {p['phase']} | " + " | ".join(str(p[k]) for k in ("sent", *OUTCOMES)) + " |"
        )
    lines += [
        "",
        "| fault | at (s) | attempts to it stopped after (s) | it answered again at (s) "
        "| attempts resumed after (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for t in result["traffic"]:
        back = "-" if t["back_after_s"] is None else f"{t['back_after_s']:.2f}"
        lines.append(
            f"| {t['fault']} | {t['at_s']:.1f} | {t['off_after_s']:.2f} | {t['returned_at_s']} | {back} |"
        )
    f = result["failover"]
    lines += [
        "",
        "| streams cut | answers continued | token-identical (checked) | control: never continued, "
        "identical (checked) | seam added p50 (ms) | p99 (ms) | continued by reason |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {f['cut']} | {f['resumed']} | {f['token_identical']} ({f['token_identical_checked']}) "
        f"| {f.get('control_identical', '-')} ({f.get('control_checked', '-')}) "
        f"| {_ms(f['seam_added_ms_p50'])} | {_ms(f['seam_added_ms_p99'])} "
        f"| {f['resumed_by_reason'] or '-'} |",
    ]
    for reason, d in f["seam_added_ms_by_reason"].items():
        lines.append(f"- seam added after `{reason}`: p50 {_ms(d['p50'])} ms, p99 {_ms(d['p99'])} ms")
    if result["error_examples"]:
        lines += ["", "Errors the clients were told:", *[f"- {e}" for e in result["error_examples"]]]
    return "\n".join(lines) + "\n"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def run_faults(
    scenario: FaultScenario,
    size_name: str,
    out_dir: Path,
    progress: Any = print,
    endpoints: list[str] | None = None,
    engine_kind: str = "vllm",
) -> dict[str, Any]:
    size = scenario.size(size_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = Run(scenario, out_dir, endpoints, engine_kind)
    try:
        progress(
            f"[{scenario.name}] starting {'redis, ' if run.uses_redis else ''}replicas and the gateway ..."
        )
        run.start()
        run.t0 = time.monotonic()
        clients = scenario.load.concurrency
        progress(f"[{scenario.name}] {clients} clients for {size.duration_s:g} s, {len(size.faults)} faults")
        outcomes, samples, inflight = run_sync(_drive(run, size))
    finally:
        run.stop()
    return report(run, outcomes, samples, inflight)
