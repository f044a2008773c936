"""The parts of the H200 run (bench/gpu/drive.sh) that are easier in Python than in bash.

python3 -m bench.gpu.host COMMAND ...   (on the GPU host, or against the simulator in a dry run)

  endpoints DRYRUN OUT.json    the managed engines' URLs and KV event endpoints (`kvgate launch --dry-run`)
  start-gateway KG TAG CONFIG  `kvgate serve` in its own session (the managed fleet outlives the call)
  wait-fleet KG GATEWAY        until every engine answers /health and the gateway routes to it
  calib KG                     tokenizer agreement, KV capacity, KV events, prefix-cache reset, warm-up
  scenario KG STEP OUT -- ARGS `kvgate bench scenario ARGS` against the managed engines, logged in steps.jsonl
  capacity DIR                 completions/s a probe run served over its whole span (prints the number)
  trace-scale --target-rps R   the Mooncake replay's time_scale that offers R requests/s
  kill-test KG GATEWAY         kill one managed replica under load: time to traffic-off and back
  pack KG OUT                  this call's results into $OUT: one tarball and the summary

Every file lands under KG (/tmp/kg on the host); `pack` returns it all, each call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench import result_files

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_DRYRUN_REPLICA = re.compile(
    r"^# (\S+) role=(\S+) url=(\S+) log=\S+(?: .*?kv_events=(\S+))?(?: .*?kv_events_replay=(\S+))?"
    r"(?: .*?device=(\S+))?"
)
_STARTED = re.compile(r"replica (\S+) started \(pid (\d+)\)")
TAR_LIMIT = 15 * 1024 * 1024  # under the 16 MiB a returned file may have


def _get(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _post_json(url: str, doc: dict[str, Any], timeout: float = 10.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(doc).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()[:300].decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return 0, str(exc)


def _write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=1, default=str))


def _endpoints(kg: Path) -> dict[str, Any]:
    return json.loads((kg / "endpoints.json").read_text())


# ---- endpoints ----------------------------------------------------------------------------------------
def endpoints(dryrun: Path, out: Path) -> int:
    names, roles, urls, events, replays, devices = [], [], [], [], [], []
    for line in dryrun.read_text().splitlines():
        m = _DRYRUN_REPLICA.match(line)
        if m:
            names.append(m.group(1))
            roles.append(m.group(2))
            urls.append(m.group(3))
            events.append(m.group(4))
            replays.append(m.group(5))
            devices.append(m.group(6))
    if not urls:
        print(f"no replicas in {dryrun}", file=sys.stderr)
        return 1
    doc = {
        "names": names,
        "urls": urls,
        # A PD fleet's roles: the benchmark's PD configurations take their legs from these.
        "roles": roles if any(r != "mixed" for r in roles) else None,
        "kv_events": events if all(events) else None,
        "kv_events_replay": replays if all(events) and all(replays) else None,
        # The GPUs replicas share (the launcher's gpu_ids): the benchmark gateways are told too.
        "devices": devices if any(devices) else None,
    }
    _write_json(out, doc)
    print(json.dumps(doc))
    return 0


# ---- start-gateway ------------------------------------------------------------------------------------
def start_gateway(kg: Path, tag: str, config: Path) -> int:
    """`kvgate serve --config CONFIG` in a session of its own, so that it outlives this device call,
    holding none of the driver's file descriptors (a pipe it kept open would keep the call waiting)."""
    env = {**os.environ, "KVGATE_CONTROL__ADMIN_KEY": (kg / "admin_key").read_text().strip()}
    with (kg / f"gateway_{tag}.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
            cwd=kg,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    (kg / f"gateway_{tag}.pid").write_text(f"{proc.pid}\n")
    time.sleep(2.0)
    if proc.poll() is not None:
        print(_tail(kg / f"gateway_{tag}.log", 4000).decode(errors="replace"), file=sys.stderr)
        return 1
    print(f"kvgate serve ({tag}) started, pid {proc.pid}")
    return 0


# ---- wait-fleet ---------------------------------------------------------------------------------------
def admin_pools(control: str, kg: Path) -> dict[str, dict[str, Any]]:
    """The managed pool's replicas as the gateway sees them, by name ({} when it does not answer),
    from its control plane (`control`: its URL)."""
    key = (kg / "admin_key").read_text().strip()
    status, body = _get(f"{control}/admin/pools", headers={"authorization": f"Bearer {key}"})
    if status != 200:
        return {}
    return {name: r for pool in json.loads(body)["pools"].values() for name, r in pool["replicas"].items()}


def replica_pid(kg: Path, name: str, tag: str) -> int:
    """The process (group) the launcher last started for replica `name`, from fleet `tag`'s log."""
    return int([p for n, p in _STARTED.findall((kg / f"gateway_{tag}.log").read_text()) if n == name][-1])


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


_START_FAILED = re.compile(r"replica (\S+) (?:exited with code \S+ while starting|not ready after)")


def crash_loops(log: Path, limit: int = 2) -> list[str]:
    """Replicas whose start failed `limit` times (a crash loop: the fleet will not come up as configured)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    counts: dict[str, int] = {}
    for name in _START_FAILED.findall(text):
        counts[name] = counts.get(name, 0) + 1
    return sorted(n for n, c in counts.items() if c >= limit)


def wait_fleet(kg: Path, control: str, deadline: float, tag: str) -> int:
    """0 when every replica serves (engine /health and the gateway's pool), 3 at the deadline (the next
    call resumes the wait), 1 when the gateway is gone. Writes KG/fleet_<tag>.json with the times."""
    eps = _endpoints(kg)
    started = float((kg / f"fleet_{tag}_started").read_text())
    path = kg / f"fleet_{tag}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"engine_ready_s": {}, "gateway_ready_s": {}}
    while True:
        now = time.time()
        pools = admin_pools(control, kg)
        for name, url in zip(eps["names"], eps["urls"], strict=True):
            if name not in doc["engine_ready_s"] and _get(f"{url}/health")[0] == 200:
                doc["engine_ready_s"][name] = round(now - started, 1)
            r = pools.get(name)
            if name not in doc["gateway_ready_s"] and r and r.get("healthy") and r.get("available"):
                doc["gateway_ready_s"][name] = round(now - started, 1)
        _write_json(path, doc)
        if len(doc["gateway_ready_s"]) == len(eps["names"]):
            doc["all_ready_s"] = max(doc["gateway_ready_s"].values())
            _write_json(path, doc)
            print(f"fleet {tag} ready: {json.dumps(doc)}")
            return 0
        if not _alive(kg / f"gateway_{tag}.pid"):
            print(f"the managing gateway ({tag}) is gone; see its log", file=sys.stderr)
            return 1
        crashed = crash_loops(kg / f"gateway_{tag}.log")
        if crashed:
            print(f"replicas that keep failing to start: {crashed}; the supervisor's log:", file=sys.stderr)
            print(_tail(kg / f"gateway_{tag}.log", 6000).decode(errors="replace"), file=sys.stderr)
            return 1
        if now > deadline:
            print(f"fleet {tag} not ready yet at {now - started:.0f} s: {json.dumps(doc)}")
            return 3
        time.sleep(1.0)


# ---- calib --------------------------------------------------------------------------------------------
def _kv_event_counts(endpoints: list[str], urls: list[str], seconds: float = 4.0) -> dict[str, int]:
    """Messages each publisher sends while each engine serves one fresh request (0: no events)."""
    import zmq

    from bench import text

    ctx = zmq.Context.instance()
    socks = []
    for ep in endpoints:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.RCVTIMEO, 100)
        s.connect(ep)
        socks.append(s)
    time.sleep(1.0)  # a SUB socket drops what is published before its connection is up
    for url in urls:
        body = {"model": MODEL, "prompt": text.words(f"kv-events:{time.time_ns()}", 300), "max_tokens": 2}
        _post_json(f"{url}/v1/completions", body)
    counts = dict.fromkeys(endpoints, 0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for ep, s in zip(endpoints, socks, strict=True):
            with contextlib.suppress(zmq.Again):
                while True:
                    s.recv_multipart()
                    counts[ep] += 1
    for s in socks:
        s.close(linger=0)
    return counts


def _replays(endpoints: list[str]) -> dict[str, Any]:
    """What each engine's replay socket answers to a request for everything it keeps: the batches,
    their numbers and events (what kvgate's subscriber reads after a gap), or why it could not."""
    import asyncio

    from gateway.routing.kv_events import decode_batch
    from gateway.routing.kv_replay import ReplayError, fetch_replay

    out: dict[str, Any] = {}
    for ep in endpoints:
        try:
            batches = asyncio.run(fetch_replay(ep, 0))
        except ReplayError as exc:
            out[ep] = {"error": str(exc)}
            continue
        events = [e for _, payload in batches for e in decode_batch(payload)[1]]
        kinds = sorted({str(e.get("type") if isinstance(e, dict) else e[0]) for e in events})
        out[ep] = {
            "batches": len(batches),
            "first_seq": batches[0][0] if batches else None,
            "last_seq": batches[-1][0] if batches else None,
            "events": len(events),
            "kinds": kinds,
        }
    return out


def calib(kg: Path, gateway: str | None, out_name: str) -> int:
    from bench import text
    from bench.scenario import ExistingFleet
    from gateway.fleet.engines.vllm import VLLMAdapter
    from gateway.prompt.tokens import get_tokenizer

    eps = _endpoints(kg)
    urls = eps["urls"]
    out: dict[str, Any] = {"replicas": eps["names"]}
    prompt = text.words("calib", 2048)
    status, doc = _post_json(
        f"{urls[0]}/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": False}
    )
    messages = [
        {"role": "system", "content": prompt},
        {"role": "user", "content": text.words("calib-q", 128)},
    ]
    status2, doc2 = _post_json(f"{urls[0]}/tokenize", {"model": MODEL, "messages": messages})
    out["tokenizer"] = {
        "gateway_tokens": get_tokenizer().count(prompt),
        "engine_tokens": doc.get("count") if isinstance(doc, dict) else f"HTTP {status}: {doc}",
        "engine_unk_ids": sum(1 for t in doc.get("tokens", []) if t == 0) if isinstance(doc, dict) else None,
        "chat_2048_plus_128_engine_tokens": doc2.get("count")
        if isinstance(doc2, dict)
        else f"HTTP {status2}",
    }
    capacity = {}
    for name, url in zip(eps["names"], urls, strict=True):
        load = VLLMAdapter().parse_load(_get(f"{url}/metrics", timeout=5)[1])
        capacity[name] = {
            "num_gpu_blocks": load.num_gpu_blocks,
            "block_size": load.block_size,
            "kv_tokens": load.kv_capacity_tokens,
        }
    out["kv_capacity"] = capacity
    # Warm-up: the first requests of a fresh engine pay for lazy initialisation.
    for url in urls:
        for i in range(3):
            n = 2048 if i == 2 else 256
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": text.words(f"warm:{url}:{i}", n)}],
            }
            _post_json(f"{url}/v1/chat/completions", {**body, "max_tokens": 8}, timeout=60)
    if eps["kv_events"]:
        counts = _kv_event_counts(eps["kv_events"], urls)
        out["kv_events"] = {"messages_per_publisher": counts, "all_publishing": all(counts.values())}
    else:
        out["kv_events"] = {"messages_per_publisher": None, "all_publishing": False}
    if eps.get("kv_events_replay"):
        out["kv_events"]["replay"] = _replays(eps["kv_events_replay"])
    out["prefix_cache_reset"] = ExistingFleet(urls).reset_prefix_caches()
    if gateway:
        metrics = _get(f"{gateway}/metrics", timeout=5)[1].decode(errors="replace")
        out["managing_gateway_kv_event_lines"] = [
            line
            for line in metrics.splitlines()
            if line.startswith("kvgate_kv_event") and "bucket" not in line
        ][:20]
    _write_json(kg / out_name, out)
    print(json.dumps(out, indent=1))
    ok = out["kv_events"]["all_publishing"] and all(v == "ok" for v in out["prefix_cache_reset"].values())
    if not ok:
        print("WARNING: KV events or prefix-cache reset missing: precise runs and cold starts are affected")
    return 0


# ---- scenario -----------------------------------------------------------------------------------------
def scenario(kg: Path, step: str, out: str, args: list[str]) -> int:
    """Run one `kvgate bench scenario` against the managed engines; log the command for the simulator."""
    eps = _endpoints(kg)
    # A replica the supervisor is restarting gets a moment; a fleet that is gone fails the step fast.
    deadline = time.monotonic() + 90
    while not all(_get(f"{u}/health")[0] == 200 for u in eps["urls"]):
        if time.monotonic() > deadline:
            print(f"engines not healthy: {[u for u in eps['urls'] if _get(f'{u}/health')[0] != 200]}")
            return 1
        time.sleep(1.0)
    target = kg / "res" / out
    argv_sim = [*args, "--out", f"{{RES}}/{out}"]
    argv = [
        sys.executable,
        "-m",
        "bench",
        "scenario",
        *args,
        "--out",
        str(target),
        "--endpoints",
        *eps["urls"],
    ]
    if eps["kv_events"]:
        argv += ["--kv-events", *eps["kv_events"]]
    if eps.get("kv_events_replay"):
        argv += ["--kv-events-replay", *eps["kv_events_replay"]]
    if eps.get("devices"):
        argv += ["--devices", *(d or "-" for d in eps["devices"])]
    if eps.get("roles"):
        argv += ["--roles", *eps["roles"]]
    started = time.time()
    rc = subprocess.call(argv, cwd=kg)
    entry = {
        "step": step,
        "out": out,
        "args": argv_sim,
        "rc": rc,
        "started": round(started, 1),
        "seconds": round(time.time() - started, 1),
    }
    with (kg / "steps.jsonl").open("a") as fh:
        fh.write(json.dumps(entry) + "\n")
    return rc


# ---- capacity -----------------------------------------------------------------------------------------
def served_rate(records: list[dict[str, Any]]) -> float | None:
    """Successful completions per second from the first request sent to the last completion.

    Not the pace in the middle of the run: on the 2026-12-01 H200 run that pace (completions/s
    between the 10th and 90th percentile completion) read 34.1 req/s for round-robin while the same
    run served 23.05 over its whole span, and the routing runs at 90% of 34.1 were overloaded (RR
    TTFT p50 5.2 s). With a deep queue vLLM batches many requests of one prefix group together,
    so the saturated middle of an overload run goes faster than any rate the fleet sustains at a
    bounded queue."""
    ok = [r for r in records if r["status"] == 200 and not r["error"] and r["e2e"]]
    if len(ok) < 20:
        return None
    first = min(r["sent"] for r in records if r["sent"] is not None)
    span = max(r["sent"] + r["e2e"] for r in ok) - first
    return len(ok) / span if span > 0 else None


def capacity(run_dir: Path) -> int:
    files = result_files.glob(run_dir / "records", "*.jsonl")
    if not files:
        print(f"no records under {run_dir}", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in result_files.read_text(files[0]).splitlines() if line.strip()]
    rate = served_rate([r for r in records if r["kind"] != "prime" and not r["warmup"]])
    if rate is None:
        print("too few completions to measure a rate", file=sys.stderr)
        return 1
    print(f"{rate:.3f}")
    return 0


def trace_scale(target_rps: float) -> int:
    """The time_scale at which the mooncake scenario's h200 size offers `target_rps` (printed)."""
    from bench.scenario import load_scenario
    from bench.workloads import make_workload

    sc = load_scenario("mooncake")
    reqs = make_workload("mooncake", {**sc.size("h200").workload, "time_scale": 1.0}).build(sc.seed)
    span = (reqs[-1].at or 0.0) - (reqs[0].at or 0.0)
    if target_rps <= 0 or span <= 0:
        return 1
    native = (len(reqs) - 1) / span
    print(f"{min(2.0, max(0.02, native / target_rps)):.3f}")
    return 0


# ---- kill-test ----------------------------------------------------------------------------------------
async def _kill_test(
    kg: Path, gateway: str, victim: str, rate: float, opts: argparse.Namespace
) -> dict[str, Any]:
    import aiohttp

    from bench.client import ClientOptions, RequestRecord, send
    from bench.loadgen import drain
    from bench.stats import error_key
    from bench.workloads import make_workload

    eps = _endpoints(kg)
    engine_url = eps["urls"][eps["names"].index(victim)]
    # Each pass has new system prompts (another seed), so prefixes nobody has cached keep arriving
    # after the restart: with the first pass's prefixes alone, prefix_affinity rightly keeps them on
    # the warm replicas and the restarted one serves nothing to measure (2026-12-01 run).
    shape = {"groups": 96, "prompts_per_group": 16, "system_tokens": opts.system_tokens}
    shape |= {"question_tokens": 128, "output_tokens": opts.output_tokens}
    requests = [r for seed in range(7, 11) for r in make_workload("shared-prefix", shape).build(seed)]
    copts = ClientOptions(model=MODEL, timeout_s=120)
    records: list[RequestRecord] = []
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    rel = lambda: round(time.perf_counter() - t0, 3)  # noqa: E731

    async def sender(session: aiohttp.ClientSession) -> None:
        rng = random.Random(11)
        tasks = []
        for i, req in enumerate(requests):
            if stop.is_set():
                break
            await asyncio.sleep(rng.expovariate(rate))
            rec = RequestRecord(index=i, kind=req.kind, priority=None, group=req.group, target=gateway)
            records.append(rec)
            tasks.append(asyncio.create_task(send(session, gateway, req, copts, rec, t0)))
        # Still running 60 s after the last send: recorded as such, not as the disconnects that
        # closing the session under them reported (2026-12-02's 51).
        await drain(tasks, 60)

    def sample() -> dict[str, Any]:
        r = admin_pools(opts.control, kg).get(victim)
        return {
            "t": rel(),
            "in_pool": r is not None,
            "healthy": bool(r and r.get("healthy")),
            "available": bool(r and r.get("available")),
            "engine_health": _get(f"{engine_url}/health", timeout=0.5)[0],
        }

    async def monitor() -> None:
        while not stop.is_set():
            timeline.append(await asyncio.to_thread(sample))
            await asyncio.sleep(0.25)

    result: dict[str, Any] = {"victim": victim, "rate": rate, "engine": engine_url}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(sender(session)), asyncio.create_task(monitor())]
        await asyncio.sleep(opts.warm_s)
        pid = replica_pid(kg, victim, opts.tag)
        result["pid"] = pid
        result["t_kill"] = rel()
        os.killpg(pid, signal.SIGKILL)  # the launcher gave the engine its own process group
        back = None
        while rel() < opts.warm_s + opts.max_s:
            await asyncio.sleep(0.5)
            gone = any(s["t"] > result["t_kill"] and not s["in_pool"] for s in timeline)
            last = timeline[-1] if timeline else None
            if gone and last and last["in_pool"] and last["healthy"] and last["available"]:
                back = last["t"]
                break
        result["t_gateway_back"] = back
        await asyncio.sleep(opts.after_s if back is not None else 0)
        stop.set()
        await asyncio.gather(*tasks)
    t_kill = result["t_kill"]
    after = [s for s in timeline if s["t"] > t_kill]
    out_samples = [s["t"] for s in after if not (s["in_pool"] and s["healthy"] and s["available"])]
    off = out_samples[0] if out_samples else None
    last_out = out_samples[-1] if out_samples else None  # the last look that found it out of the pool
    engine_back = next((s["t"] for s in after if s["engine_health"] == 200 and off and s["t"] > off), None)
    sent_after = [r for r in records if r.sent is not None and r.sent > t_kill]
    served_again = [r.sent for r in sent_after if r.replica == victim and r.ok]
    in_flight = [r for r in records if r.sent is not None and r.sent <= t_kill <= r.sent + (r.e2e or 1e9)]
    # A stream the victim was serving cannot move: those are the failures a crash must cost at most.
    errors = dict(Counter(error_key(r) for r in records if not r.ok))
    result.update(
        traffic_off_s=round(off - t_kill, 3) if off is not None else None,
        engine_healthy_again_s=round(engine_back - t_kill, 1) if engine_back is not None else None,
        gateway_routes_again_s=round(back - t_kill, 1) if back is not None else None,
        first_request_served_again_s=round(min(served_again) - t_kill, 1) if served_again else None,
        sent_to_victim_while_out=sum(
            1 for r in sent_after if r.replica == victim and off and last_out and off < r.sent < last_out
        ),
        requests=len(records),
        ok=sum(1 for r in records if r.ok),
        errors=errors,
        in_flight_at_kill=len(in_flight),
        in_flight_at_kill_failed=sum(1 for r in in_flight if not r.ok),
        failed_after_traffic_off=sum(1 for r in sent_after if not r.ok and off is not None and r.sent > off),
    )
    out = kg / "res" / opts.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    (out / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in timeline))
    _write_json(out / "kill.json", result)
    return result


def run_sync_kill(
    kg: Path, gateway: str, victim: str, rate: float, opts: argparse.Namespace
) -> dict[str, Any]:
    from bench.loadgen import run_sync

    return run_sync(_kill_test(kg, gateway, victim, rate, opts))


def kill_test(kg: Path, gateway: str, opts: argparse.Namespace) -> int:
    result = run_sync_kill(kg, gateway, opts.victim, opts.rate, opts)
    print(json.dumps(result, indent=1))
    return 0 if result.get("gateway_routes_again_s") is not None else 1


# ---- pack ---------------------------------------------------------------------------------------------
def _tail(path: Path, limit: int = 2 * 1024 * 1024) -> bytes:
    """The last `limit` bytes of a file."""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read()


def pack(kg: Path, out: Path) -> int:
    """KG into OUT/kg.tar.gz (engine logs cut to their last 2 MiB; without per-request records when
    the tarball would not come back whole), plus the summary and the step log beside it."""
    from bench.gpu import compare

    out.mkdir(parents=True, exist_ok=True)
    summary = compare.render(kg, None)
    (kg / "summary.md").write_text(summary)
    for keep_records in (True, False):
        tar_path = out / "kg.tar.gz"
        with tarfile.open(tar_path, "w:gz") as tar:
            for path in sorted(kg.rglob("*")):
                if not path.is_file() or path.name.endswith((".pid", "admin_key")):
                    continue
                rel = Path("kg") / path.relative_to(kg)
                if not keep_records and path.suffix == ".jsonl" and "records" in path.parts:
                    continue
                if path.suffix == ".log" and path.stat().st_size > 2 * 1024 * 1024:
                    data = _tail(path)
                    info = tarfile.TarInfo(str(rel))
                    info.size = len(data)
                    info.mtime = int(path.stat().st_mtime)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.add(path, arcname=str(rel))
        if tar_path.stat().st_size <= TAR_LIMIT:
            break
        print(f"kg.tar.gz is {tar_path.stat().st_size} bytes: packing again without the per-request records")
    for name in ("summary.md", "steps.jsonl", "drive.log"):
        if (kg / name).exists():
            (out / name).write_bytes((kg / name).read_bytes())
    print(summary)
    print(f"packed {tar_path.stat().st_size} bytes into {tar_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.host", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("endpoints")
    e.add_argument("dryrun", type=Path)
    e.add_argument("out", type=Path)
    g = sub.add_parser("start-gateway")
    g.add_argument("kg", type=Path)
    g.add_argument("tag")
    g.add_argument("config", type=Path)
    w = sub.add_parser("wait-fleet")
    w.add_argument("kg", type=Path)
    w.add_argument("control", help="the gateway's control plane URL (control.host:control.port)")
    w.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    w.add_argument("--tag", default="fp8")
    c = sub.add_parser("calib")
    c.add_argument("kg", type=Path)
    c.add_argument("--gateway")
    c.add_argument("--out", default="calib.json", help="file name under KG")
    s = sub.add_parser("scenario")
    s.add_argument("kg", type=Path)
    s.add_argument("step")
    s.add_argument("out")
    s.add_argument("args", nargs=argparse.REMAINDER)
    ts = sub.add_parser("trace-scale")
    ts.add_argument("--target-rps", type=float, required=True)
    cap = sub.add_parser("capacity")
    cap.add_argument("dir", type=Path)
    k = sub.add_parser("kill-test")
    k.add_argument("kg", type=Path)
    k.add_argument("gateway")
    k.add_argument("--control", required=True, help="the gateway's control plane URL")
    k.add_argument("--victim", default="h200-1")
    k.add_argument("--rate", type=float, required=True)
    k.add_argument("--warm-s", type=float, default=15.0)
    k.add_argument("--max-s", type=float, default=240.0, help="give up waiting for the restart after this")
    k.add_argument("--after-s", type=float, default=10.0, help="load kept on after the replica is back")
    k.add_argument("--system-tokens", type=int, default=2048, help="shared-prefix groups' system prompts")
    k.add_argument("--output-tokens", type=int, default=32, help="tokens each answer streams")
    k.add_argument("--tag", default="fp8", help="the fleet whose gateway log names the victim's pid")
    k.add_argument("--name", default="kill_restart", help="the results' folder under res/")
    pk = sub.add_parser("pack")
    pk.add_argument("kg", type=Path)
    pk.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "endpoints":
        return endpoints(a.dryrun, a.out)
    if a.cmd == "start-gateway":
        return start_gateway(a.kg, a.tag, a.config)
    if a.cmd == "wait-fleet":
        return wait_fleet(a.kg, a.control, a.deadline, a.tag)
    if a.cmd == "calib":
        return calib(a.kg, a.gateway, a.out)
    if a.cmd == "scenario":
        args = a.args[1:] if a.args[:1] == ["--"] else a.args
        return scenario(a.kg, a.step, a.out, args)
    if a.cmd == "capacity":
        return capacity(a.dir)
    if a.cmd == "trace-scale":
        return trace_scale(a.target_rps)
    if a.cmd == "kill-test":
        return kill_test(a.kg, a.gateway, a)
    return pack(a.kg, a.out)


if __name__ == "__main__":
    sys.exit(main())
