"""The docker-compose stacks, checked without Docker: every file, port, build context, variable
and config they reference, and the Grafana dashboard's queries against series that really exist.

The last test runs the CPU stack's own commands as local processes (simulator replicas from the
compose `sim` command, the gateway from config/compose.yaml with service names pointed at
127.0.0.1) and checks that every metric the Grafana dashboard queries is exported.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings, load_config
from gateway.server import start_gateway
from tests.conftest import PYTHON, REPO, wait_until
from tests.simfleet import sim_command

BASE = REPO / "docker-compose.yml"
GPU = REPO / "docker-compose.gpu.yml"
ENV_EXAMPLE = REPO / ".env.example"
CONFIG_TARGET = "/etc/kvgate/config.yaml"
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}")


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(text: str) -> str:
    """Compose's `${VAR:-default}` substitution, with .env.example as the environment."""
    env = env_example()

    def sub(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", "-") and not value:
            return default
        return value or ""

    return VAR.sub(sub, text)


def load_compose(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(interpolate(path.read_text()))
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict), path
    return doc


def merge(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge for the keys these files use: mappings merge, `volumes` merge by container
    path, other sequences are replaced by the override's."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v, k) if k in base else v
        return out
    if key == "volumes" and isinstance(base, list) and isinstance(override, list):
        by_target = {str(v).split(":")[1]: v for v in base}
        by_target.update({str(v).split(":")[1]: v for v in override})
        return list(by_target.values())
    return override


def stacks() -> dict[str, dict[str, Any]]:
    return {"cpu": load_compose(BASE), "gpu": merge(load_compose(BASE), load_compose(GPU))}


def active(stack: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services started by a plain `up` (no profile named)."""
    return {n: s for n, s in stack["services"].items() if not s.get("profiles")}


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts."""
    out = {}
    for v in service.get("volumes", []):
        source, target = str(v).split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (REPO / source).resolve()
    return out


def service_ports(stack: dict[str, Any], name: str) -> set[int]:
    """Ports a service listens on inside the network (expose ranges, published container ports,
    and --port of its command)."""
    svc = stack["services"][name]
    ports: set[int] = set()
    for item in svc.get("expose", []):
        lo, _, hi = str(item).partition("-")
        ports.update(range(int(lo), int(hi or lo) + 1))
    for item in svc.get("ports", []):
        ports.add(int(str(item).rsplit(":", 1)[-1]))
    if svc.get("command") and "--port" in svc["command"]:
        ports.add(int(svc["command"][svc["command"].index("--port") + 1]))
    return ports


def gateway_config(stack: dict[str, Any]) -> Settings:
    return load_config(bind_mounts(stack["services"]["gateway"])[CONFIG_TARGET])


def flag(command: list[str], name: str) -> str:
    return str(command[command.index(name) + 1])


# -- static checks ------------------------------------------------------------------------------


def test_every_variable_has_a_default_or_is_documented() -> None:
    documented = env_example()
    used: set[str] = set()
    for path in (BASE, GPU):
        for m in VAR.finditer(path.read_text()):
            used.add(m.group(1))
            # Stricter than compose needs: defaulted or not, every variable is documented.
            assert m.group(1) in documented, f"{path.name}: ${{{m.group(1)}}} missing from .env.example"
    assert not (set(documented) - used), f".env.example documents unused {set(documented) - used}"
    assert "$" not in yaml.safe_dump(stacks()["gpu"]), "an unresolved variable is left"


@pytest.mark.parametrize("stack_name", ["cpu", "gpu"])
def test_referenced_files_build_contexts_and_services_exist(stack_name: str) -> None:
    stack = stacks()[stack_name]
    services = active(stack)
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            context = REPO / svc["build"]["context"]
            assert context.is_dir(), name
            assert (context / svc["build"]["dockerfile"]).is_file(), name
        for target, source in bind_mounts(svc).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) is missing"
            assert REPO in source.parents, f"{name}: mounts {source} from outside the repository"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on {dep}, which does not start"
    published = [str(p).rsplit(":", 2) for s in services.values() for p in s.get("ports", [])]
    assert all(addr == "127.0.0.1" for addr, _, _ in published), "ports bind loopback by default"
    host_ports = [int(host) for _, host, _ in published]
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"


def test_dockerfile_is_slim_non_root_and_checks_health() -> None:
    dockerfile = REPO / "docker" / "Dockerfile"
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())  # join continued lines
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages and all(s == "python:3.11-slim" for s in stages)
    final = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER kvgate$", final, re.M) and "useradd" in final
    assert re.search(r"^EXPOSE 8000 9002$", final, re.M)  # the data plane, and EPP mode's gRPC
    assert re.search(r"^HEALTHCHECK .*CMD", final, re.M)
    assert re.search(r'^ENTRYPOINT \["kvgate"\]', final, re.M)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^kvgate = "gateway\.cli:main"', pyproject, re.M)
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            if "*" not in src:
                assert (REPO / src).exists(), f"COPY {src}: missing"
            allowed = [src, f"{src}/", *(f"{parent}/" for parent in Path(src).parents if parent != Path("."))]
            assert any(f"!{a}" in ignore for a in allowed), f"COPY {src} is excluded by the dockerignore"


def test_the_image_serves_the_demo_without_a_mounted_config() -> None:
    """`docker run kvgate:local` used to exit at once (no /etc/kvgate/config.yaml): its default
    command now finds the demo config in the image, listening beyond the container's loopback."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "docker" / "Dockerfile").read_text())
    final = text.rsplit("\nFROM ", 1)[1]
    cmd = json.loads(re.findall(r"^CMD (\[.*\])$", final, re.M)[-1])
    assert cmd[:2] == ["serve", "--config"]
    config = cmd[2]
    sources = [
        line.split()[0]
        for line in re.findall(r"^COPY (?!--from)(.+)$", final, re.M)
        if line.split()[-1] == config
    ]
    assert sources == ["config/demo.yaml"], f"nothing in the image at {config}"
    assert re.search(r"^ENV .*\bKVGATE_SERVER__HOST=0\.0\.0\.0\b", final, re.M)
    demo = load_config(REPO / sources[0], {"server": {"host": "0.0.0.0"}})
    assert [p.engines.kind for p in demo.pools if p.engines is not None] == ["sim"]


@pytest.mark.parametrize("stack_name", ["cpu", "gpu"])
def test_gateway_config_matches_the_stack(stack_name: str) -> None:
    stack = stacks()[stack_name]
    services = active(stack)
    gw = services["gateway"]
    assert gw["command"] == ["serve", "--config", CONFIG_TARGET]
    settings = gateway_config(stack)
    assert settings.server.host == "0.0.0.0"
    assert settings.server.port in service_ports(stack, "gateway")
    assert settings.control.host == "0.0.0.0" and settings.control.port in service_ports(stack, "gateway")
    assert settings.telemetry.tracing and settings.telemetry.metrics
    assert settings.state.backend == "redis"
    redis = urlsplit(settings.state.redis_url)
    assert redis.hostname in services and redis.port == 6379
    # the gateway's settings from the environment are real settings keys
    env = {k: v for k, v in gw["environment"].items() if k.startswith("KVGATE_")}
    for key in env:
        section, _, field = key.removeprefix("KVGATE_").lower().partition("__")
        assert field in type(getattr(settings, section)).model_fields, key
    otlp = urlsplit(gw["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert otlp.hostname in services and otlp.port in service_ports(stack, otlp.hostname)
    for pool in settings.pools:
        for ep in pool.endpoints:
            url = urlsplit(ep.url)
            assert url.hostname in services, f"{ep.url}: no such service"
            assert url.port in service_ports(stack, url.hostname), f"{ep.url}: nothing listens there"
            engine = services[url.hostname]["command"]
            name = "--served-model-name" if "--served-model-name" in engine else "--model"
            assert (pool.served_model or pool.model) == flag(engine, name), f"{ep.url} serves another model"


def test_simulator_ports_match_its_replicas() -> None:
    stack = stacks()["cpu"]
    command = stack["services"]["sim"]["command"]
    base, replicas = int(flag(command, "--port")), int(flag(command, "--replicas"))
    listening = set(range(base, base + replicas))
    assert service_ports(stack, "sim") == listening
    used = {urlsplit(ep.url).port for p in gateway_config(stack).pools for ep in p.endpoints}
    assert used == listening, "every simulated replica is in a pool, and only those"
    prometheus = yaml.safe_load((REPO / "docker/prometheus/prometheus.yml").read_text())
    targets = {
        t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert {f"sim:{p}" for p in listening} <= targets


@pytest.mark.parametrize("stack_name", ["cpu", "gpu"])
def test_prometheus_scrapes_what_runs(stack_name: str) -> None:
    stack = stacks()[stack_name]
    services = active(stack)
    (config,) = [p for t, p in bind_mounts(services["prometheus"]).items() if t.endswith("prometheus.yml")]
    doc = yaml.safe_load(config.read_text())
    jobs = {job["job_name"]: job for job in doc["scrape_configs"]}
    assert {"kvgate", "engines"} <= set(jobs)
    for job in jobs.values():
        for target in (t for sc in job["static_configs"] for t in sc["targets"]):
            host, _, port = target.partition(":")
            assert host in services and int(port) in service_ports(stack, host), f"{stack_name}: {target}"


def test_grafana_provisioning_and_dashboard() -> None:
    stack = stacks()["cpu"]
    services = active(stack)
    grafana = services["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    uids = {s["uid"]: s for s in sources}
    for s in sources:
        url = urlsplit(s["url"])
        assert url.hostname in services and url.port in service_ports(stack, url.hostname) | {9090, 16686}
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvgate.yml").read_text())["providers"]
    dashboards_dir = mounts[provider["options"]["path"]]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards_dir / Path(home).relative_to(provider["options"]["path"])).is_file()
    dashboard = json.loads((dashboards_dir / "kvgate.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    for p in panels:
        assert p["datasource"]["uid"] in uids and uids[p["datasource"]["uid"]]["type"] == "prometheus"
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_otel_collector_pipeline() -> None:
    stack = stacks()["cpu"]
    services = active(stack)
    collector = services["otel-collector"]
    (config,) = bind_mounts(collector).values()
    assert f"--config={next(iter(bind_mounts(collector)))}" in collector["command"]
    doc = yaml.safe_load(config.read_text())
    traces = doc["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert traces[kind] and set(traces[kind]) <= set(doc[kind]), kind
    http = doc["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    otlp = urlsplit(services["gateway"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert http.endswith(f":{otlp.port}") and otlp.port in service_ports(stack, "otel-collector")
    jaeger = doc["exporters"]["otlp/jaeger"]["endpoint"]
    host, _, port = jaeger.partition(":")
    assert host in services and int(port) in service_ports(stack, host)


# -- the CPU stack's commands, run as local processes --------------------------------------------


@pytest.fixture
def simulator() -> Iterator[list[str]]:
    """The compose `sim` service's command, bound to loopback on ports it picks; the replicas' URLs."""
    command = [str(a) for a in load_compose(BASE)["services"]["sim"]["command"]]
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = "0"
    with sim_command([PYTHON, "-m", "gateway", *command], int(flag(command, "--replicas"))) as fleet:
        yield fleet.urls


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported(text: str) -> set[str]:
    """Series names a scrape can hold, including labelled families with no child yet."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def queried(exprs: list[str], prefix: str) -> set[str]:
    return set(re.findall(rf"\b({re.escape(prefix)}[a-zA-Z0-9_:]+)", " ".join(exprs)))


async def test_cpu_stack_runs_and_serves_every_dashboard_series(
    simulator: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")  # no collector here; tracing stays on
    stack = stacks()["cpu"]
    config = gateway_config(stack).model_dump()
    base = int(flag(stack["services"]["sim"]["command"], "--port"))
    for pool in config["pools"]:  # service names -> loopback, compose ports -> the ones we got
        for ep in pool["endpoints"]:
            ep["url"] = simulator[urlsplit(ep["url"]).port - base]  # type: ignore[operator]
    config["server"].update(host="127.0.0.1", port=0)
    config["state"].update(redis_url="redis://127.0.0.1:6379/15", key_prefix=f"kvgate-test-{os.getpid()}")
    settings = load_config(None, config)
    gw = await start_gateway(settings)
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            await wait_until(lambda: all(gw.runtime.data_plane.pools_ready().values()), 10, "pools ready")
            for i in range(8):
                body = {
                    "model": "llama",
                    "messages": [{"role": "user", "content": f"shared prefix for the stack test, turn {i}"}],
                    "max_tokens": 4,
                    "stream": i % 2 == 0,
                    "user": f"user-{i}",
                }
                headers = {"x-canary": "1"} if i == 7 else {}
                resp = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert resp.status_code == 200, resp.text
            gateway_series = exported((await client.get("/metrics")).text)
            engine_series = exported((await client.get(f"{simulator[0]}/metrics")).text)
            dashboard = (await client.get("/dashboard/state")).json()
    finally:
        await gw.stop()
    assert dashboard["totals"]["replicas"] == 4
    assert {p["name"] for p in dashboard["pools"]} == {"stable", "canary"}
    panels = json.loads((REPO / "docker/grafana/dashboards/kvgate.json").read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    missing = queried(exprs, "kvgate_") - gateway_series
    assert not missing, f"the dashboard queries series the gateway does not export: {missing}"
    missing = queried(exprs, "vllm:") - engine_series
    assert not missing, f"the dashboard queries engine series the simulator does not export: {missing}"
