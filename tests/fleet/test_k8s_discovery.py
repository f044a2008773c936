"""Kubernetes discovery through the real client library (kubernetes_asyncio) against tests/kube_api.py.

Every test runs a real gateway whose pool discovers its replicas from a test API server on a
loopback socket; the replicas' targets are real HTTP servers (tests/upstream_app.py) or, under
load, real simulator processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import KubernetesDiscoveryConfig
from gateway.fleet.discovery.kubernetes import KubernetesDiscovery, pod_endpoints, slice_endpoints
from gateway.fleet.pool import Pool
from gateway.server import RunningGateway
from tests.conftest import PYTHON, gateway_settings, subprocess_env, wait_until
from tests.kube_api import KubeAPI, flag
from tests.simfleet import sim_process

NS = "kv"
SELECTOR = "kvgate.io/pool=p"
POOL_LABELS = {"kvgate.io/pool": "p", "app": "engine"}
Gateway = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def kube() -> AsyncIterator[KubeAPI]:
    api = await KubeAPI(bookmark_interval_s=0.1).start()
    yield api
    await api.stop()


@pytest.fixture
def k8s_gateway(gateway, kube, tmp_path) -> Gateway:
    async def make(**discovery: Any) -> RunningGateway:
        cfg: dict[str, Any] = {
            "kubeconfig": str(kube.kubeconfig(tmp_path / "kubeconfig")),
            "label_selector": SELECTOR,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.2,
            "drain_timeout_s": 10,
        }
        cfg.update(discovery)
        pool = {"discovery": {"kubernetes": cfg}}
        return await gateway(gateway_settings([], pool=pool, control={"admin_key": "admin-key"}))

    return make


def pool_of(gw: RunningGateway) -> Pool:
    return gw.runtime.pools["p"]


def source(gw: RunningGateway) -> KubernetesDiscovery:
    (d,) = gw.runtime.fleet.discoveries
    return d


def urls(gw: RunningGateway) -> set[str]:
    return {r.url for r in pool_of(gw).replicas.values()}


async def test_ready_pods_join_and_leave_by_readiness_and_selector(kube, upstreams, k8s_gateway):
    a, b, c = await upstreams(3)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    kube.put_pod(NS, "b", b.port, labels=POOL_LABELS, ready=False)
    kube.put_pod(NS, "c", c.port, labels={"kvgate.io/pool": "other"})
    kube.put_pod("elsewhere", "d", c.port, labels=POOL_LABELS)
    gw = await k8s_gateway()
    await wait_until(lambda: urls(gw) == {a.url}, what="the ready pod of the selector")
    assert source(gw).namespace == NS  # from the kubeconfig context

    kube.set_pod_ready(NS, "b", True)
    await wait_until(lambda: urls(gw) == {a.url, b.url}, what="b to join once ready")
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for _ in range(4):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            assert r.status_code == 200
    assert a.state.seen and b.state.seen

    # A config reload (SIGHUP, admin API) leaves discovered replicas alone, as the admin API does.
    assert gw.runtime.reloader.apply(gw.runtime.settings, "test")["changes"] == []
    admin = {"authorization": "Bearer admin-key"}
    async with httpx.AsyncClient(base_url=gw.control_url, headers=admin) as client:
        r = await client.delete("/admin/pools/p/replicas/a")
    assert r.status_code == 409 and "leaves with its pod" in r.json()["error"]["message"]
    assert urls(gw) == {a.url, b.url}

    kube.set_pod_ready(NS, "a", False)
    await wait_until(lambda: urls(gw) == {b.url}, what="a to leave once unready")
    # A label change that takes the pod out of the selector arrives as DELETED.
    pod = kube.get("pods", NS, "b")
    pod["metadata"]["labels"] = {"kvgate.io/pool": "moved"}
    kube.put("pods", NS, pod)
    await wait_until(lambda: urls(gw) == set(), what="b to leave the selector")
    assert source(gw).stats["lists"] == 1 and source(gw).stats["expired"] == 0
    # Every watch asked for bookmarks, from a version, with a bounded timeout.
    for q in kube.watch_requests():
        assert flag(q["allowWatchBookmarks"]) and q["resourceVersion"] and int(q["timeoutSeconds"]) > 0


async def test_a_pod_ready_again_before_its_drain_ends_keeps_its_replica(kube, upstreams, k8s_gateway):
    (a,) = await upstreams(1)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    gw = await k8s_gateway()
    await wait_until(lambda: "a" in pool_of(gw).replicas, what="replica a")
    replica = pool_of(gw).replicas["a"]
    async with httpx.AsyncClient(base_url=gw.url) as client:
        # The upstream holds this answer 2 s: the drain below has a request to wait for.
        slow = asyncio.create_task(
            client.post(
                "/v1/completions", json={"model": "m", "prompt": "x"}, headers={"x-test-mode": "stall:2"}
            )
        )
        await wait_until(lambda: replica.inflight_requests == 1, what="the request in flight")
        kube.set_pod_ready(NS, "a", False)
        await wait_until(lambda: replica.draining, what="the drain")
        assert not replica.available and pool_of(gw).replicas.get("a") is replica
        kube.set_pod_ready(NS, "a", True)
        await wait_until(lambda: not replica.draining, what="the undrain")
        assert (await slow).status_code == 200
    assert pool_of(gw).replicas["a"] is replica, "the same replica, with its prefix index"


async def test_removed_replica_leaves_the_prefix_index(kube, upstreams, k8s_gateway):
    (a,) = await upstreams(1)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    gw = await k8s_gateway()
    await wait_until(lambda: "a" in pool_of(gw).replicas, what="replica a")
    async with httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post(
            "/v1/completions", json={"model": "m", "prompt": "a shared system prompt " * 20}
        )
        assert r.status_code == 200
    index = gw.runtime.routers["p"].match.index
    assert index.snapshot("a"), "routing taught the index what a holds"
    kube.terminate_pod(NS, "a")
    await wait_until(lambda: "a" not in pool_of(gw).replicas, what="a to be removed")
    assert index.snapshot("a") == []


async def test_expired_watch_event_relists_and_sees_the_deletions_it_missed(kube, upstreams, k8s_gateway):
    a, b = await upstreams(2)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    kube.put_pod(NS, "b", b.port, labels=POOL_LABELS)
    gw = await k8s_gateway()
    await wait_until(lambda: urls(gw) == {a.url, b.url}, what="both pods")
    await wait_until(lambda: len(kube.watches) == 1, what="the watch")
    # No await between these: the watch is cut, b goes while nobody watches, the history with it.
    kube.drop_watches()
    kube.delete("pods", NS, "b")
    kube.compact()
    await wait_until(lambda: urls(gw) == {a.url}, what="b removed after the re-list")
    st = source(gw).stats
    assert st["expired"] == 1 and st["lists"] == 2
    # The first watch, its resumption from the expired version, then one from the new list's version.
    await wait_until(lambda: len(kube.watch_requests()) == 3, what="the watch after the re-list")
    first, expired, fresh = (q["resourceVersion"] for q in kube.watch_requests())
    assert expired == first and fresh == str(kube.rv)


async def test_expired_as_http_410_relists(kube, upstreams, k8s_gateway):
    a, b = await upstreams(2)
    kube.gone_as_status = True
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    gw = await k8s_gateway()
    await wait_until(lambda: urls(gw) == {a.url}, what="pod a")
    await wait_until(lambda: len(kube.watches) == 1, what="the watch")
    kube.drop_watches()
    kube.delete("pods", NS, "a")
    kube.put_pod(NS, "b", b.port, labels=POOL_LABELS)
    kube.compact()
    await wait_until(lambda: urls(gw) == {b.url}, what="the re-listed state")
    assert source(gw).stats["expired"] == 1 and source(gw).stats["lists"] == 2


async def test_a_server_that_expires_every_watch_is_backed_off_not_hammered(kube, upstreams, k8s_gateway):
    (a,) = await upstreams(1)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    kube.expire_every_watch = True
    gw = await k8s_gateway()
    await wait_until(lambda: source(gw).stats["expired"] >= 4, what="repeated expiries")
    st = source(gw).stats
    # The first 410 re-lists at once; each one after it, with no event between, backs off first.
    assert st["errors"] >= st["expired"] - 2 and st["lists"] <= st["expired"] + 1
    assert urls(gw) == {a.url}, "the pool keeps what the lists said"


async def test_bookmarks_move_the_resume_point_past_a_compaction(kube, upstreams, k8s_gateway):
    (a,) = await upstreams(1)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    gw = await k8s_gateway(watch_timeout_s=1)
    await wait_until(lambda: urls(gw) == {a.url}, what="pod a")
    listed_at = source(gw).resource_version
    # Changes the selector hides: the version moves on without an event for this watch.
    for i in range(3):
        kube.put_pod(NS, f"other-{i}", a.port, labels={"kvgate.io/pool": "other"})
    await wait_until(
        lambda: source(gw).resource_version == str(kube.rv), what="a bookmark at the latest version"
    )
    kube.compact()
    # The watch times out after 1 s and resumes from the bookmark's version, which the server still
    # serves; from the list's version it would have been 410 and a re-list.
    await wait_until(lambda: len(kube.watch_requests()) >= 2, what="the watch to resume")
    resumed = kube.watch_requests()[1]["resourceVersion"]
    assert int(resumed) > int(listed_at) and resumed == str(kube.compacted_rv)
    st = source(gw).stats
    assert st["bookmarks"] >= 1 and st["expired"] == 0 and st["lists"] == 1
    kube.put_pod(NS, "late", a.port, labels=POOL_LABELS)
    await wait_until(lambda: "late" in pool_of(gw).replicas, what="events after the resumed watch")


async def test_dropped_watch_resumes_from_the_last_version_without_relisting(kube, upstreams, k8s_gateway):
    a, b = await upstreams(2)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    gw = await k8s_gateway()
    await wait_until(lambda: urls(gw) == {a.url}, what="pod a")
    await wait_until(lambda: len(kube.watches) == 1, what="the watch")
    seen_version = source(gw).resource_version
    kube.drop_watches()
    kube.put_pod(NS, "b", b.port, labels=POOL_LABELS)  # while nobody watches: replayed on resume
    await wait_until(lambda: urls(gw) == {a.url, b.url}, what="b from the resumed watch")
    st = source(gw).stats
    assert st["lists"] == 1 and st["expired"] == 0 and st["errors"] >= 1
    assert kube.watch_requests()[1]["resourceVersion"] == seen_version


async def test_api_errors_back_off_then_recover(kube, upstreams, k8s_gateway):
    (a,) = await upstreams(1)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    kube.fail_next = [500, 503, 429]
    gw = await k8s_gateway()
    await wait_until(lambda: urls(gw) == {a.url}, what="pod a after three failed lists")
    assert source(gw).stats["errors"] == 3 and source(gw).stats["lists"] == 1


async def test_wrong_token_is_refused_and_retried(kube, upstreams, gateway, tmp_path, caplog):
    (a,) = await upstreams(1)
    kube.put_pod(NS, "a", a.port, labels=POOL_LABELS)
    cfg = {
        "kubeconfig": str(kube.kubeconfig(tmp_path / "kc", token="not-the-token")),
        "label_selector": SELECTOR,
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.05,
    }
    gw = await gateway(gateway_settings([], pool={"discovery": {"kubernetes": cfg}}))
    await wait_until(lambda: source(gw).stats["errors"] >= 3, what="refusals")
    assert pool_of(gw).replicas == {}
    assert "API error 401" in caplog.text and "not-the-token" not in caplog.text


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "ca.crt", tmp_path / "key.pem"
    argv = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=kube-test",
    ]
    argv += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    subprocess.run(argv, check=True, capture_output=True)
    return cert, key


async def test_in_cluster_service_account_over_tls(upstreams, gateway, tmp_path, monkeypatch):
    """The pod's service account: KUBERNETES_SERVICE_HOST/PORT, token, CA and namespace files."""
    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    api = await KubeAPI(token="sa-token").start(ssl_context=ctx)
    try:
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        (sa / "token").write_text("sa-token")
        (sa / "ca.crt").write_bytes(cert.read_bytes())
        (sa / "namespace").write_text("inference\n")
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", api.url.rsplit(":", 1)[1])
        (a,) = await upstreams(1)
        api.put_pod("inference", "a", a.port, labels=POOL_LABELS)
        cfg = {"label_selector": SELECTOR, "service_account_dir": str(sa)}
        gw = await gateway(gateway_settings([], pool={"discovery": {"kubernetes": cfg}}))
        await wait_until(lambda: urls(gw) == {a.url}, what="the pod, found with the service account")
        assert source(gw).namespace == "inference"
    finally:
        await api.stop()


async def test_endpointslices(kube, upstreams, k8s_gateway):
    a, b, c = await upstreams(3)
    labels = {
        "kubernetes.io/service-name": "llama-decode",
        "kvgate.io/role": "decode",
        "kvgate.io/engine": "sglang",
    }

    def endpoint(pod: str, ready: bool | None, terminating: bool = False) -> dict[str, Any]:
        cond: dict[str, Any] = {"terminating": terminating}
        if ready is not None:
            cond["ready"] = ready
        return {
            "addresses": ["127.0.0.1"],
            "conditions": cond,
            "targetRef": {"kind": "Pod", "name": pod, "uid": f"pod-uid-{pod}"},
        }

    # One Service per port set: each pod's port differs here, so each gets its own slice.
    def put_slice(name: str, port: int, eps: list[dict[str, Any]]) -> None:
        kube.put(
            "endpointslices",
            NS,
            {
                "metadata": {"name": name, "labels": labels},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
                "endpoints": eps,
            },
        )

    put_slice("s-a", a.port, [endpoint("pa", True)])
    put_slice("s-b", b.port, [endpoint("pb", None)])  # unknown readiness reads as ready
    put_slice("s-c", c.port, [endpoint("pc", False)])
    gw = await k8s_gateway(
        resource="endpointslices", label_selector="kubernetes.io/service-name=llama-decode"
    )
    await wait_until(lambda: urls(gw) == {a.url, b.url}, what="the ready endpoints")
    replicas = pool_of(gw).replicas
    assert {(r.role, r.kind) for r in replicas.values()} == {("decode", "sglang")}
    assert set(replicas) == {"pa", "pb"}
    put_slice("s-a", a.port, [endpoint("pa", False, terminating=True)])
    put_slice("s-c", c.port, [endpoint("pc", True)])
    await wait_until(lambda: urls(gw) == {b.url, c.url}, what="a terminating, c ready")
    kube.delete("endpointslices", NS, "s-b")
    await wait_until(lambda: urls(gw) == {c.url}, what="the deleted slice's endpoint to go")


def test_labels_and_annotations_describe_the_engine():
    cfg = KubernetesDiscoveryConfig(label_selector=SELECTOR, port="http", kind="vllm")
    pod = {
        "metadata": {
            "name": "p-0",
            "uid": "u1",
            "labels": {"kvgate.io/role": "prefill", "kvgate.io/engine": "sglang"},
            "annotations": {"kvgate.io/kv-events-port": "5557", "kvgate.io/role": "decode"},
        },
        "spec": {
            "containers": [
                {
                    "ports": [
                        {"name": "http", "containerPort": 30000},
                        {"name": "bootstrap", "containerPort": 8998},
                    ]
                }
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": "fd00::5",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    (ep,) = pod_endpoints(pod, cfg).values()
    assert ep.url == "http://[fd00::5]:30000" and ep.kind == "sglang"
    assert ep.role == "decode"  # the annotation wins over the label
    assert ep.kv_events == "tcp://[fd00::5]:5557" and ep.bootstrap_port == 8998
    pod["metadata"]["labels"]["kvgate.io/engine"] = "tensorrt"
    assert pod_endpoints(pod, cfg) == {}  # an unknown engine kind is skipped, not guessed
    pod["metadata"]["labels"]["kvgate.io/engine"] = "vllm"
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_endpoints(pod, cfg) == {}
    numbered = KubernetesDiscoveryConfig(label_selector=SELECTOR, port=8000)
    sl = {"metadata": {"name": "s"}, "ports": [], "endpoints": [{"addresses": ["10.0.0.7"]}]}
    (ep,) = slice_endpoints(sl, numbered).values()
    assert ep.url == "http://10.0.0.7:8000" and ep.role == "mixed" and ep.kind == "vllm"


def test_discovery_without_the_client_library_is_one_line_error(tmp_path):
    cfg = tmp_path / "k8s.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"pools": [{"name": "p", "model": "m", "discovery": {"kubernetes": {"label_selector": "a=b"}}}]}
        )
    )
    # The client is installed here: hide it the way Python marks a module unimportable.
    script = (
        "import sys; sys.modules['kubernetes_asyncio'] = None; from gateway.cli import main; "
        f"sys.exit(main(['check-config', {str(cfg)!r}]))"
    )
    out = subprocess.run(
        [PYTHON, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=30
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "pools.0.discovery" in line and "pip install 'kvgate[kubernetes]'" in line


# -- under load -----------------------------------------------------------------------------
async def test_pods_come_and_go_under_load_without_a_failed_request(kube, k8s_gateway):
    """A steady stream of requests while pods are added, made unready, deleted and re-created.

    Each pod's engine is a real simulator process. The engine of a deleted pod is killed as soon
    as its replica leaves the pool: a request still in flight there, or sent there later, would
    fail. No retry may hide one either: the pool's retry counter stays at zero."""
    with (
        contextlib.ExitStack() as stack_a,
        contextlib.ExitStack() as stack_b,
        contextlib.ExitStack() as stack_c,
    ):
        url_a = stack_a.enter_context(sim_process(speedup=4))
        url_b = stack_b.enter_context(sim_process(speedup=4))
        url_c = stack_c.enter_context(sim_process(speedup=4))

        def port(url: str) -> int:
            return int(url.rsplit(":", 1)[1])

        kube.put_pod(NS, "pod-a", port(url_a), labels=POOL_LABELS)
        gw = await k8s_gateway()
        pool = pool_of(gw)
        await wait_until(lambda: urls(gw) == {url_a}, what="pod-a")

        results: list[int] = []
        stop = asyncio.Event()

        async def client_loop(i: int) -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                n = 0
                while not stop.is_set():
                    n += 1
                    stream = n % 2 == 0
                    body = {
                        "model": "m",
                        "prompt": f"client {i} request {n}",
                        "max_tokens": 24,
                        "stream": stream,
                    }
                    r = await client.post("/v1/completions", json=body)
                    results.append(r.status_code)

        def served(name: str) -> int:
            replica = pool.replicas.get(name)
            return replica.total_requests if replica is not None else 0

        clients = [asyncio.create_task(client_loop(i)) for i in range(6)]
        try:
            await wait_until(lambda: served("pod-a") >= 10, timeout=20, what="traffic on pod-a")
            # added: not ready first, then ready
            kube.put_pod(NS, "pod-b", port(url_b), labels=POOL_LABELS, ready=False)
            kube.set_pod_ready(NS, "pod-b", True)
            await wait_until(lambda: served("pod-b") >= 10, timeout=20, what="traffic on pod-b")
            # made unready: drained, removed, then back as a fresh replica
            await wait_until(lambda: pool.replicas["pod-a"].inflight_requests > 0, what="work on pod-a")
            kube.set_pod_ready(NS, "pod-a", False)  # with requests in flight there, which must finish
            await wait_until(lambda: "pod-a" not in pool.replicas, timeout=20, what="pod-a drained")
            kube.set_pod_ready(NS, "pod-a", True)
            await wait_until(lambda: served("pod-a") >= 10, timeout=20, what="pod-a back")
            # deleted: terminating (drain), removed, its engine killed at once
            await wait_until(lambda: pool.replicas["pod-b"].inflight_requests > 0, what="work on pod-b")
            kube.terminate_pod(NS, "pod-b")
            await wait_until(lambda: "pod-b" not in pool.replicas, timeout=20, what="pod-b drained")
            stack_b.close()
            kube.delete("pods", NS, "pod-b")
            # re-created under the same name (a StatefulSet's pod), elsewhere
            kube.put_pod(NS, "pod-b", port(url_c), labels=POOL_LABELS)
            await wait_until(lambda: served("pod-b") >= 10, timeout=20, what="the re-created pod-b")
            assert pool.replicas["pod-b"].url == url_c
        finally:
            stop.set()
            await asyncio.gather(*clients)
    assert len(results) > 60 and set(results) == {200}, {s: results.count(s) for s in set(results)}
    retries = gw.runtime.metrics.registry.get_sample_value("kvgate_retries_total", {"pool": "p"})
    assert not retries
