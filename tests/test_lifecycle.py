"""The gateway as a real process: config errors, graceful shutdown on SIGTERM."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import time

import httpx
import openai
import yaml

from gateway.server import GC_YOUNG_THRESHOLD, settle_gc
from tests.conftest import PYTHON, STARTUP_S, free_port, subprocess_env, wait_until, wait_until_sync


def kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a real process (it must exit by itself)."""
    return subprocess.run(
        [PYTHON, "-m", "gateway", *args], capture_output=True, text=True, env=subprocess_env(), timeout=30
    )


def test_bad_config_exits_nonzero_naming_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"pools": [{"name": "p", "model": "m", "engines": {"replicas": 0}}]}))
    out = kvgate("serve", "--config", str(cfg))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pools.0.engines.replicas" in lines[0]
    check = kvgate("check-config", str(cfg))
    assert check.returncode == 2 and "pools.0.engines.replicas" in check.stderr


def test_bench_without_its_extra_says_what_to_install() -> None:
    """`kvgate bench` on an install without matplotlib (a plain `pip install kvgate`, the Docker
    image): one line naming the extra, not a traceback, for `--help` too."""
    hide = "import sys; sys.modules['matplotlib'] = None; from gateway.cli import main; sys.exit(main())"
    for args in (["bench", "--help"], ["bench", "list"]):
        out = subprocess.run(
            [PYTHON, "-c", hide, *args], capture_output=True, text=True, env=subprocess_env(), timeout=60
        )
        assert out.returncode == 2 and out.stderr.splitlines() == [
            "kvgate bench needs matplotlib: pip install 'kvgate[bench]'"
        ]


async def wait_ready(client: httpx.AsyncClient, url: str) -> None:
    """Until the gateway process answers /ready with 200 (it starts listening after a moment)."""

    async def ready() -> bool:
        try:
            return (await client.get(url + "/ready")).status_code == 200
        except httpx.TransportError:
            return False

    await wait_until(ready, STARTUP_S, "the gateway to be ready", 0.05)


async def test_sigterm_lets_inflight_stream_finish_then_exits_zero(upstreams, tmp_path):
    (up,) = await upstreams(1)
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "server": {"port": port, "grace_period_s": 10},
                "pools": [
                    {
                        "name": "p",
                        "model": "m",
                        "policy": {"type": "round_robin"},
                        "endpoints": [{"url": up.url}],
                    }
                ],
            }
        )
    )
    proc = subprocess.Popen(
        [PYTHON, "-m", "gateway", "serve", "--config", str(cfg)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as c:
            await wait_ready(c, url)
            body = {"model": "m", "prompt": "p", "stream": True}
            # The upstream holds its answer 1 s; SIGTERM arrives while the request is in flight.
            async with c.stream(
                "POST", url + "/v1/completions", json=body, headers={"x-test-mode": "stall:1"}
            ) as r:
                await wait_until(lambda: bool(up.state.seen), what="the request to reach the upstream")
                proc.send_signal(signal.SIGTERM)
                text = (await r.aread()).decode()
            assert r.status_code == 200 and text.endswith("data: [DONE]\n\n")
        # new connections are refused once draining (a fresh client: no pooled keep-alive)
        refused = False
        async with httpx.AsyncClient() as fresh:
            try:
                await fresh.get(url + "/health")
            except httpx.TransportError:
                refused = True
        assert refused
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_taken_port_fails_with_one_line_before_launching_engines(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        logs = tmp_path / "engine-logs"
        cfg = tmp_path / "gw.yaml"
        engines = {"kind": "sim", "replicas": 1, "log_dir": str(logs), "sim": {"profile": "tiny"}}
        cfg.write_text(
            yaml.safe_dump(
                {"server": {"port": port}, "pools": [{"name": "p", "model": "m", "engines": engines}]}
            )
        )
        out = kvgate("serve", "--config", str(cfg))
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
    assert not logs.exists() or not any(logs.iterdir())


async def test_sigterm_fails_readiness_first_serves_through_the_delay_then_closes(upstreams, tmp_path):
    """A Kubernetes rollout: /ready fails at SIGTERM, new connections are still served during
    `shutdown_delay_s` (the Service takes that long to stop sending), then the listener closes and
    the process exits 0."""
    (up,) = await upstreams(1)
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    pool = {"name": "p", "model": "m", "policy": {"type": "round_robin"}, "endpoints": [{"url": up.url}]}
    # A delay long enough that a loaded machine still checks readiness and serves within it.
    delay = 5
    server = {"port": port, "grace_period_s": 5, "shutdown_delay_s": delay}
    cfg.write_text(yaml.safe_dump({"server": server, "pools": [pool]}))
    proc = subprocess.Popen(
        [PYTHON, "-m", "gateway", "serve", "--config", str(cfg)],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as c:
            await wait_ready(c, url)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # Fresh clients each time: a new connection is what a load balancer would open.
        while True:
            async with httpx.AsyncClient() as fresh:
                ready = await fresh.get(url + "/ready")
            if ready.status_code == 503:
                break
            assert time.monotonic() - signalled < delay, "readiness did not fail within the delay"
        assert ready.json()["draining"] is True
        async with httpx.AsyncClient() as fresh:
            r = await fresh.post(url + "/v1/completions", json={"model": "m", "prompt": "p"})
        assert r.status_code == 200  # a fresh connection: the listener is still open

        async def closed() -> bool:
            try:
                async with httpx.AsyncClient() as fresh:
                    await fresh.get(url + "/health")
            except httpx.TransportError:
                return True
            return False

        await wait_until(closed, delay + 30, "the listener to close", 0.05)
        assert time.monotonic() - signalled >= delay, "the listener closed after the delay"
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_settle_gc_freezes_what_exists_and_collects_young_objects_less_often() -> None:
    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_embedded_default_says_when_ready_then_serves_tool_calls(tmp_path) -> None:
    """`make run`'s `kvgate serve` without a config: the line it logs when the simulated fleet is
    ready, after which the first request is answered (not 503), and tool calls as a vLLM launched
    for them makes them: auto (when the user names a tool), required, named."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [PYTHON, "-m", "gateway", "serve", "--port", str(port)],
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=tmp_path,  # the engines' logs land here
        )
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            return f"kvgate ready on http://127.0.0.1:{port}: " in log.read_text()

        wait_until_sync(ready, STARTUP_S, "the ready line", 0.1)
        assert "waiting for engines to become healthy" in log.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        hi = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}])
        assert hi.choices[0].message.content
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
        ask = [{"role": "user", "content": "Please call get_weather for Oslo."}]
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(
                model="llama", messages=ask, tools=[weather], tool_choice=choice, max_tokens=200
            )
            (call,) = r.choices[0].message.tool_calls or []
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) is not None
        plain = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "Hi"}], tools=[weather], max_tokens=4
        )
        assert plain.choices[0].message.tool_calls is None  # auto: no tool named, no call
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
