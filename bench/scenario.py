"""Side-by-side scenarios: the same workload against several gateway configurations in turn.

A scenario (YAML in bench/scenarios/) names a workload, a simulated fleet, the configurations
to compare and, per size (`quick` for CI, `full`), the workload parameters and load points.
Each configuration is either `direct` (the client round-robins over the engines itself) or a
gateway whose config is the base YAML deep-merged with the scenario's and the configuration's
overrides. Every (configuration, load point) gets a fresh fleet, so no run inherits another
run's warm caches.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from bench import engine_metrics, kv_agreement, loadgen, procs
from bench.client import ClientOptions
from bench.loadgen import LoadSpec
from bench.stats import summarize
from bench.workloads import BenchRequest, make_workload

if TYPE_CHECKING:
    from bench.faults import FaultScenario

log = logging.getLogger(__name__)

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
BASE_GATEWAY_CONFIG = SCENARIO_DIR / "base_gateway.yaml"
DEFAULT_OUT = Path("results") / "out"  # under the working directory, never inside the package
POOL_NAME = "bench"


@dataclass
class FleetGroup:
    """One simulator process serving `replicas` replicas of one role."""

    replicas: int = 1
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    args: list[str] = field(default_factory=list)
    profile: str | None = None  # the fleet's profile unless set: a heterogeneous fleet


@dataclass
class FleetSpec:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    profile: str = "h200-llama3.1-8b"
    speedup: float = 1.0
    replicas: int = 4
    args: list[str] = field(default_factory=list)  # extra simulator flags (vLLM's names)
    groups: list[FleetGroup] | None = None  # instead of replicas/args: e.g. a PD split
    module: str = "gateway.sim"  # `python -m <module> --model --port --replicas --profile --speedup`
    kv_events: bool = False  # publish KV events (vLLM's ZMQ format), named on each endpoint
    startup_timeout_s: float = 60.0

    def fleet_groups(self) -> list[FleetGroup]:
        return self.groups or [FleetGroup(replicas=self.replicas, args=list(self.args))]


@dataclass
class ConfigSpec:
    name: str
    # gateway: kvgate serve; direct: the client round-robins over the engines; epp: Envoy in front
    # of `kvgate epp` on the same config (bench/epp.py); router: `router` (sglang-router, smg).
    mode: Literal["gateway", "direct", "epp", "router"] = "gateway"
    router: str | None = None
    description: str = ""
    pool: dict[str, Any] = field(default_factory=dict)  # merged into the benchmark pool
    gateway: dict[str, Any] = field(default_factory=dict)  # merged into the whole gateway config
    fleet: dict[str, Any] = field(default_factory=dict)  # FleetSpec fields to override
    gateways: int = 1  # gateway instances in front of the one fleet; the client alternates between them


@dataclass
class SizeSpec:
    workload: dict[str, Any] = field(default_factory=dict)
    loads: list[dict[str, Any]] = field(default_factory=lambda: [{"rate": 4.0}])
    duration_s: float | None = None
    max_requests: int | None = None
    warmup_requests: int = 0
    warmup_s: float = 0.0
    drain_timeout_s: float = 120.0
    fleet: dict[str, Any] = field(default_factory=dict)
    configs: list[str] | None = None  # the configs this size runs (default: all)


@dataclass
class Scenario:
    name: str
    workload: str
    configs: list[ConfigSpec]
    description: str = ""
    baseline: str | None = None  # ratios are relative to this config (default: the first)
    seed: int = 0
    api: Literal["chat", "completions"] = "chat"
    ignore_eos: bool = True
    request_timeout_s: float = 300.0
    fleet: FleetSpec = field(default_factory=FleetSpec)
    gateway: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, SizeSpec] = field(default_factory=lambda: {"quick": SizeSpec(), "full": SizeSpec()})

    @property
    def baseline_name(self) -> str:
        return self.baseline or self.configs[0].name

    def size(self, name: str) -> SizeSpec:
        try:
            return self.sizes[name]
        except KeyError:
            raise ValueError(f"scenario {self.name!r} has no size {name!r}: {sorted(self.sizes)}") from None


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `override` merged in: dicts recursively, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _fleet(data: dict[str, Any]) -> FleetSpec:
    data = dict(data)
    if data.get("groups") is not None:
        data["groups"] = [FleetGroup(**g) for g in data["groups"]]
    return FleetSpec(**data)


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    try:
        return _scenario_from_dict(dict(data))
    except TypeError as exc:  # a key no dataclass has: name the scenario and the key
        raise ValueError(f"scenario {data.get('name')!r}: {exc}") from None


def _scenario_from_dict(data: dict[str, Any]) -> Scenario:
    data["configs"] = [ConfigSpec(**c) for c in data.get("configs") or []]
    if not data["configs"]:
        raise ValueError(f"scenario {data.get('name')!r} has no configs")
    data["fleet"] = _fleet(data.get("fleet") or {})
    data["sizes"] = {k: SizeSpec(**v) for k, v in (data.get("sizes") or {"quick": {}}).items()}
    scenario = Scenario(**data)
    names = [c.name for c in scenario.configs]
    if scenario.baseline_name not in names:
        raise ValueError(f"baseline {scenario.baseline_name!r} is not one of the configs {names}")
    return scenario


def available_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml") if p.stem != BASE_GATEWAY_CONFIG.stem)


def load_scenario(name_or_path: str) -> Scenario | FaultScenario:
    """A workload scenario, or (`kind: faults`) a fault schedule run by bench/faults.py."""
    path = Path(name_or_path)
    if not path.exists():
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(f"no scenario {name_or_path!r}; built-in: {', '.join(available_scenarios())}")
    data = yaml.safe_load(path.read_text())
    if data.get("kind") == "faults":
        from bench.faults import fault_scenario_from_dict  # it builds on this module

        return fault_scenario_from_dict(data)
    return scenario_from_dict(data)


def load_spec(point: dict[str, Any], size: SizeSpec, seed: int) -> LoadSpec:
    point = dict(point)
    if "rate" in point:
        mode = "poisson"
    elif "concurrency" in point:
        mode = "closed"
    else:
        mode = "trace"
    spec = LoadSpec(
        mode=point.pop("mode", mode),
        rate=point.pop("rate", None),
        concurrency=point.pop("concurrency", None),
        duration_s=point.pop("duration_s", size.duration_s),
        max_requests=point.pop("max_requests", size.max_requests),
        warmup_requests=point.pop("warmup_requests", size.warmup_requests),
        warmup_s=point.pop("warmup_s", size.warmup_s),
        drain_timeout_s=point.pop("drain_timeout_s", size.drain_timeout_s),
        seed=seed,
        burst_period_s=point.pop("burst_period_s", None),
        burst_high=point.pop("burst_high", 2.0),
        burst_low=point.pop("burst_low", 0.2),
    )
    if point:
        raise ValueError(f"load point has unknown keys {sorted(point)}")
    return spec


def gateway_config(
    scenario: Scenario, config: ConfigSpec, fleet: FleetSpec, endpoints: list[dict[str, Any]], port: int
) -> dict[str, Any]:
    base = yaml.safe_load(BASE_GATEWAY_CONFIG.read_text()) or {}
    merged = deep_merge(deep_merge(base, scenario.gateway), config.gateway)
    merged = deep_merge(merged, {"server": {"host": procs.HOST, "port": port}})
    pool = deep_merge(
        {"name": POOL_NAME, "model": fleet.model, "endpoints": endpoints},
        deep_merge(merged.pop("pool", {}) or {}, config.pool),
    )
    merged["pools"] = [pool]
    return merged


@dataclass
class RunPoint:
    config: str
    load: str
    offered_rps: float | None
    summary: dict[str, Any]
    ttft_ms: list[float] = field(default_factory=list)  # successful measured requests, for the CDF


class Fleet:
    """The simulator processes of one run."""

    def __init__(self, spec: FleetSpec, log_dir: Path, tag: str):
        self.spec = spec
        self.children: list[procs.Child] = []
        self.endpoints: list[dict[str, Any]] = []
        self.log_dir = log_dir
        self.tag = tag
        self._at_start: dict[str, Any] = {}

    def start(self) -> Fleet:
        try:
            for i, group in enumerate(self.spec.fleet_groups()):
                n = group.replicas
                base = procs.free_port_range(2 * n if self.spec.kv_events else n)
                urls = [f"http://{procs.HOST}:{base + k}" for k in range(n)]
                # Publishers take the n ports after the HTTP ones: the simulator offsets each
                # replica's port by its index, as vLLM does per rank. As vLLM, it binds only an
                # endpoint holding `*` (and the topic is left at vLLM's default, "").
                kv = [f"tcp://{procs.HOST}:{base + n + k}" for k in range(n)] if self.spec.kv_events else []
                config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{base + n}"} if kv else None
                events = ["--kv-events-config", json.dumps(config)] if config else []
                argv = procs.python_module(
                    self.spec.module,
                    "--model", self.spec.model,
                    "--port", str(base),
                    "--replicas", str(group.replicas),
                    "--profile", group.profile or self.spec.profile,
                    "--speedup", str(self.spec.speedup),
                    *events,
                    *group.args,
                )  # fmt: skip
                child = procs.Child(
                    f"fleet {i} ({group.role})", argv, self.log_dir / f"{self.tag}-fleet{i}.log"
                )
                self.children.append(child.start())
                share = _gpu_share(group.args)
                self.endpoints += [
                    {
                        "url": u,
                        "role": group.role,
                        "kind": "sim",
                        **({"kv_events": kv[k]} if kv else {}),
                        # The gateway knows which replicas share a simulated GPU, as a launcher's
                        # gpu_ids tell it which share a real one.
                        **({"device": f"fleet{i}-gpu{k // share}"} if share > 1 else {}),
                    }
                    for k, u in enumerate(urls)
                ]
                child.wait_ready([f"{u}/health" for u in urls], self.spec.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        # A fresh fleet's counters are zero but for the adapters its --lora-modules read from disk
        # at start: only the run's own count.
        self._at_start = engine_metrics.fleet_counters(self.urls)
        return self

    @property
    def urls(self) -> list[str]:
        return [e["url"] for e in self.endpoints]

    def counters(self) -> dict[str, Any]:
        return engine_metrics.counter_delta(self._at_start, engine_metrics.fleet_counters(self.urls))

    def describe(self) -> dict[str, Any]:
        return {"profile": self.spec.profile, "speedup": self.spec.speedup}

    def stop(self) -> None:
        for child in self.children:
            child.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _gpu_share(args: list[str]) -> int:
    """The simulator's `--gpu-share N` among a fleet group's arguments (1 without it)."""
    for flag, value in itertools.pairwise(args):
        if flag == "--gpu-share":
            return int(value)
    return 1


# How each engine kind empties its prefix cache (vLLM: only with VLLM_SERVER_DEV_MODE=1), its CPU
# tier (--kv-offloading-size) included: vLLM resets the connector's cache only when asked to, and
# treats the request as a no-op success without a connector.
RESET_PATHS = {
    "vllm": "/reset_prefix_cache?reset_external=true",
    "sim": "/reset_prefix_cache?reset_external=true",
    "sglang": "/flush_cache",
}


@dataclass
class ExistingFleet:
    """Engines that someone else runs (`--endpoints`), used in place of a fresh simulated fleet.

    Each run starts from empty prefix caches all the same: before it, every engine's cache is reset
    (retried while the engine still holds blocks, e.g. of requests a previous run abandoned); an
    engine that has no reset endpoint is reported, not fatal. Its counters are read before and after
    the run, so the report shows what this run did. The scenario's simulator settings (profile,
    speedup, engine flags) describe what the engines should be and are not applied to them."""

    urls: list[str]
    kv_events: list[str] | None = None  # the engines' ZMQ publishers, one per URL (precise mode)
    kind: Literal["vllm", "sglang", "sim"] = "vllm"
    reset_timeout_s: float = 60.0
    devices: list[str | None] | None = None  # the GPU each engine shares with others (endpoints[].device)
    # What each engine was launched as (prefill: a kv_producer, decode: a kv_consumer); a
    # configuration with a PD split (fleet.groups) takes its prefill and decode replicas from these.
    roles: list[Literal["mixed", "prefill", "decode"]] | None = None
    # Their publishers' replay sockets (vLLM's replay_endpoint), one per URL: missed batches asked for.
    kv_events_replay: list[str] | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("--endpoints needs at least one URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        if self.kv_events is not None and len(self.kv_events) != len(self.urls):
            raise ValueError(f"{len(self.kv_events)} KV event endpoints for {len(self.urls)} engines")
        if self.kv_events_replay is not None and len(self.kv_events_replay) != len(self.urls):
            raise ValueError(f"{len(self.kv_events_replay)} replay endpoints for {len(self.urls)} engines")
        if self.devices is not None and len(self.devices) != len(self.urls):
            raise ValueError(f"{len(self.devices)} devices for {len(self.urls)} engines")
        if self.roles is not None and len(self.roles) != len(self.urls):
            raise ValueError(f"{len(self.roles)} roles for {len(self.urls)} engines")

    def attach(self, spec: FleetSpec) -> AttachedFleet:
        if spec.kv_events and not self.kv_events:
            raise ValueError("this configuration needs the engines' KV events: give --kv-events")
        endpoints = []
        for k, role in self._pick(spec):
            endpoint: dict[str, Any] = {"url": self.urls[k], "kind": self.kind}
            if role != "mixed":
                endpoint["role"] = role
            if spec.kv_events:
                events = self.kv_events[k]  # type: ignore[index]
                replay = self.kv_events_replay[k] if self.kv_events_replay else None
                endpoint["kv_events"] = {"endpoint": events, "replay_endpoint": replay} if replay else events
            if self.devices and (d := self.devices[k]):
                endpoint["device"] = d
            endpoints.append(endpoint)
        return AttachedFleet(self, endpoints)

    def _pick(self, spec: FleetSpec) -> list[tuple[int, str]]:
        """(engine index, the role it plays in this run): every engine for a plain fleet of as many
        replicas or more, the first `replicas` for a smaller one; for a PD split, each group's
        replicas from the engines launched in its role (a mixed group from any engine left)."""
        if spec.groups is None:
            return [(k, "mixed") for k in range(min(spec.replicas, len(self.urls)))]
        if self.roles is None:
            raise ValueError("a prefill/decode fleet (fleet.groups) on --endpoints needs --roles")
        free = list(range(len(self.urls)))
        picked: list[tuple[int, str]] = []
        for group in spec.groups:
            fits = [k for k in free if group.role == "mixed" or self.roles[k] == group.role]
            if len(fits) < group.replicas:
                raise ValueError(f"{group.replicas} {group.role} replicas wanted, {len(fits)} engines left")
            for k in fits[: group.replicas]:
                free.remove(k)
                picked.append((k, group.role))
        return picked

    def reset_prefix_caches(self) -> dict[str, str]:
        """POST the kind's reset to every engine; per URL "ok", "unsupported (HTTP 404)" or why not."""
        path = RESET_PATHS[self.kind]
        deadline = time.monotonic() + self.reset_timeout_s
        outcome: dict[str, str] = {}
        for url in self.urls:
            while True:
                outcome[url] = _reset_once(url + path)
                if (
                    outcome[url] == "ok"
                    or outcome[url].startswith("unsupported")
                    or time.monotonic() > deadline
                ):
                    break
                time.sleep(0.5)
        return outcome


def _reset_once(url: str) -> str:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read(4096)
    except urllib.error.HTTPError as exc:
        # 404/405: no such endpoint (vLLM without VLLM_SERVER_DEV_MODE); 409: blocks still in use.
        return f"unsupported (HTTP {exc.code})" if exc.code in (404, 405) else f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"unreachable: {exc}"
    # vLLM answers an empty 200 or {"success": bool} depending on the version; the simulator the latter.
    try:
        doc = json.loads(body) if body.strip() else {}
    except ValueError:
        doc = {}
    return "ok" if not isinstance(doc, dict) or doc.get("success", True) else "refused (success: false)"


class AttachedFleet:
    """One run's view of an ExistingFleet: the same interface as Fleet, nothing to start or stop."""

    def __init__(self, existing: ExistingFleet, endpoints: list[dict[str, Any]]):
        self.existing = existing
        self.endpoints = endpoints
        self.reset: dict[str, str] = {}
        self._before: dict[str, float] = {}

    @property
    def urls(self) -> list[str]:
        return [e["url"] for e in self.endpoints]

    def start(self) -> AttachedFleet:
        self.reset = self.existing.reset_prefix_caches()
        failed = {u: r for u, r in self.reset.items() if r != "ok"}
        if failed:
            log.warning("prefix caches not reset, this run may start warm: %s", failed)
        self._before = engine_metrics.fleet_counters(self.urls)
        return self

    def counters(self) -> dict[str, Any]:
        return engine_metrics.counter_delta(self._before, engine_metrics.fleet_counters(self.urls))

    def describe(self) -> dict[str, Any]:
        return {"existing": self.urls, "prefix_cache_reset": self.reset}

    def stop(self) -> None:
        pass

    def __enter__(self) -> AttachedFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def run_point(
    scenario: Scenario,
    config: ConfigSpec,
    size: SizeSpec,
    point: dict[str, Any],
    requests: list[BenchRequest],
    out_dir: Path,
    existing: ExistingFleet | None = None,
) -> RunPoint:
    fleet_spec = _fleet(deep_merge(deep_merge(_asdict(scenario.fleet), size.fleet), config.fleet))
    load = load_spec(point, size, scenario.seed)
    tag = f"{config.name}-{_slug(load.label)}"
    opts = ClientOptions(
        model=fleet_spec.model,
        api=scenario.api,
        ignore_eos=scenario.ignore_eos,
        timeout_s=scenario.request_timeout_s,
    )
    log_dir = out_dir / "logs"
    fleet_run = Fleet(fleet_spec, log_dir, tag) if existing is None else existing.attach(fleet_spec)
    with fleet_run.start() as fleet:
        pd_paths: dict[str, float] = {}
        matched: dict[str, float] = {}
        if config.mode == "direct":
            result = loadgen.run_sync(loadgen.run(requests, load, fleet.urls, opts, len(fleet.urls)))
        elif config.mode in ("epp", "router"):
            from bench import epp

            with contextlib.ExitStack() as fronts:
                if config.mode == "router":
                    log = log_dir / f"{tag}-{config.router}.log"
                    url = fronts.enter_context(
                        epp.router(config.router or "", fleet.urls, log, fleet_spec.startup_timeout_s)
                    )
                else:
                    cfg = gateway_config(scenario, config, fleet_spec, fleet.endpoints, 0)
                    front = epp.EnvoyEpp(cfg, fleet.urls, log_dir, tag, "full")
                    url = fronts.enter_context(front.running(fleet_spec.startup_timeout_s)).url
                result = loadgen.run_sync(loadgen.run(requests, load, [url], opts, len(fleet.urls)))
        else:
            run_id = uuid.uuid4().hex[:12]
            with contextlib.ExitStack() as gateways:
                urls = []
                for i in range(config.gateways):
                    name = config.name if config.gateways == 1 else f"{config.name}-{i}"
                    port = procs.free_port_range(1)
                    cfg = gateway_config(scenario, config, fleet_spec, fleet.endpoints, port)
                    # Shared state (state.backend redis) starts empty for every run, like the caches.
                    cfg.setdefault("state", {})["key_prefix"] = f"kvgate-bench-{run_id}"
                    cfg_path = out_dir / "configs" / f"{name}.yaml"
                    cfg_path.parent.mkdir(parents=True, exist_ok=True)
                    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
                    argv = procs.python_module("gateway", "serve", "--config", str(cfg_path))
                    url = f"http://{procs.HOST}:{port}"
                    log_path = log_dir / f"{tag}-gateway{'' if i == 0 else i}.log"
                    child = procs.Child(f"gateway {name}", argv, log_path)
                    gateways.enter_context(child.start()).wait_ready(
                        [f"{url}/ready"], fleet_spec.startup_timeout_s
                    )
                    urls.append(url)
                result = loadgen.run_sync(loadgen.run(requests, load, urls, opts, len(fleet.urls)))
                pd_paths = engine_metrics.gateway_pd_paths(urls)
                matched = kv_agreement.gateway_matched(urls)
        engine = fleet.counters()
    records_path = out_dir / "records" / f"{tag}.jsonl"
    records_path.parent.mkdir(parents=True, exist_ok=True)
    with records_path.open("w") as fh:
        for r in result.records:
            fh.write(json.dumps(r.to_dict()) + "\n")
    summary = summarize(result)
    if engine:
        if "lora_swaps" in engine and result.wall_s > 0:
            # Per minute of the run (simulated minutes at a speedup other than 1: the engines' clock).
            minutes = result.wall_s * fleet_spec.speedup / 60.0
            engine["lora_swaps_per_min"] = engine["lora_swaps"] / minutes
            engine["lora_disk_loads_per_min"] = engine["lora_disk_loads"] / minutes
        summary["engine"] = engine
    if pd_paths:
        summary["pd"] = pd_paths
    elif engine and (agreement := kv_agreement.agreement(matched, engine)):
        summary["kv_agreement"] = agreement  # not for PD: a decode leg's loads are the prefill's KV
    summary["fleet"] = {**fleet.describe(), "replicas": len(fleet.urls)}
    return point_from_result(config.name, result, summary)


def point_from_result(config: str, result: loadgen.RunResult, summary: dict[str, Any]) -> RunPoint:
    ttfts = [r.ttft * 1000.0 for r in result.records if r.ok and not r.warmup and r.ttft is not None]
    return RunPoint(config, result.load.label, result.offered_rate, summary, ttfts)


def _asdict(fleet: FleetSpec) -> dict[str, Any]:
    return dataclasses.asdict(fleet)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in ".=" else "_" for c in label).strip("_")


def run_scenario(
    scenario: Scenario,
    size_name: str,
    out_dir: Path,
    only: list[str] | None = None,
    progress: Any = print,
    failures: list[str] | None = None,
    existing: ExistingFleet | None = None,
) -> list[RunPoint]:
    """Run every (configuration, load point) in turn; returns their summaries.

    A configuration that cannot start (its gateway or fleet fails, its target refuses the
    priming request) raises, unless `failures` is given: then the reason is appended there and
    the other configurations still run, so one broken config does not cost a long run. With
    `existing` every run goes to those engines instead of a fresh simulated fleet."""
    size = scenario.size(size_name)
    workload = make_workload(scenario.workload, size.workload)
    requests = workload.build(scenario.seed)
    wanted = only or size.configs
    configs = [c for c in scenario.configs if not wanted or c.name in wanted]
    if not configs:
        raise ValueError(f"none of {wanted} is a config of {scenario.name!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    points: list[RunPoint] = []
    for config in configs:
        for point in size.loads:
            progress(f"[{scenario.name}] {config.name} @ {load_spec(point, size, scenario.seed).label} ...")
            try:
                rp = run_point(scenario, config, size, point, requests, out_dir, existing)
            except (procs.ProcessError, loadgen.TargetError) as exc:
                if failures is None:
                    raise
                label = load_spec(point, size, scenario.seed).label
                failures.append(f"{config.name} @ {label}: {str(exc).splitlines()[0]}")
                progress(f"    FAILED: {exc}")
                continue
            s = rp.summary
            progress(
                f"    ok {s['ok']}/{s['requests']}  TTFT p50 {_fmt(s['ttft_ms']['p50'])} ms  "
                f"p95 {_fmt(s['ttft_ms']['p95'])} ms  hit {_fmt(s['cache_hit_rate'], 2)}"
            )
            for warning in s["warnings"]:
                progress(f"    WARNING: {warning}")
            points.append(rp)
    return points


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
