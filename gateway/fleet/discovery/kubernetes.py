"""A pool's replicas from the Kubernetes API: list, then watch, like client-go's Reflector.

The source lists the pods (or EndpointSlices) its label selector matches in one namespace, then
watches from the list's `resourceVersion` with `allowWatchBookmarks` and a bounded
`timeoutSeconds`, resuming each new watch from the last version seen (an event's or a
bookmark's). `410 Gone` (an HTTP status, or an ERROR watch event with code 410: the version has
left the server's history) clears the resume point and lists again, so deletions missed meanwhile
are seen too. Other API errors and dropped connections back off exponentially, with jitter, and
resume from the last version. After every list and event the ready endpoints go to a
`Reconciler`, which adds, drains and removes replicas.

Ready means: a pod Running, with condition Ready True, a pod IP and no deletion timestamp; an
EndpointSlice endpoint whose `ready` condition is not false and that is not terminating. Per pod
(or per EndpointSlice, whose labels mirror its Service's) the labels or annotations below say what
it runs; an annotation wins over a label of the same name.

Uses `kubernetes_asyncio` (the `kvgate[kubernetes]` extra), imported only when a pool asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import aiohttp
import orjson

from gateway.config import KubernetesDiscoveryConfig
from gateway.fleet.discovery.membership import Endpoint, Membership, Reconciler
from gateway.fleet.replica import Role

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

log = logging.getLogger(__name__)

ENGINE_KEY = "kvgate.io/engine"  # vllm | sglang | sim | openai
ROLE_KEY = "kvgate.io/role"  # mixed | prefill | decode
KV_EVENTS_PORT_KEY = "kvgate.io/kv-events-port"  # number or port name of the engine's KV event publisher
KV_EVENTS_REPLAY_PORT_KEY = "kvgate.io/kv-events-replay-port"  # and of its replay socket (vLLM)
BOOTSTRAP_PORT_KEY = "kvgate.io/bootstrap-port"  # number or port name: SGLang prefill bootstrap
# Port names looked up when the annotations are absent.
KV_EVENTS_PORT_NAME = "kv-events"
KV_EVENTS_REPLAY_PORT_NAME = "kv-events-replay"
BOOTSTRAP_PORT_NAME = "bootstrap"

KINDS = frozenset(("vllm", "sglang", "sim", "openai"))
ROLES: frozenset[str] = frozenset(get_args(Role))
MAX_LIST_BYTES = 64 * 1024 * 1024  # a list response beyond this is refused, not buffered


def _lookup(meta: Mapping[str, Any], key: str) -> str | None:
    for field in ("annotations", "labels"):
        values = meta.get(field) or {}
        if isinstance(values, Mapping) and isinstance(values.get(key), str):
            return values[key]
    return None


def _port(spec: int | str | None, named: Mapping[str, int]) -> int | None:
    """A port given as a number or a name (looked up in `named`); None when a name is unknown."""
    if spec is None:
        return None
    if isinstance(spec, int):
        return spec
    if spec.isdigit():
        return int(spec)
    return named.get(spec)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _endpoint(
    name: str,
    address: str,
    meta: Mapping[str, Any],
    ports: Mapping[str, int],
    cfg: KubernetesDiscoveryConfig,
) -> Endpoint | None:
    port = _port(cfg.port, ports)
    if port is None:
        log.warning("%s: no port %r (ports: %s)", name, cfg.port, dict(ports))
        return None
    kind = _lookup(meta, ENGINE_KEY) or cfg.kind
    role = _lookup(meta, ROLE_KEY) or cfg.role
    if kind not in KINDS or role not in ROLES:
        log.warning("%s: unknown %s %r or %s %r, skipped", name, ENGINE_KEY, kind, ROLE_KEY, role)
        return None
    kv_port = _port(_lookup(meta, KV_EVENTS_PORT_KEY) or KV_EVENTS_PORT_NAME, ports)
    replay_port = _port(_lookup(meta, KV_EVENTS_REPLAY_PORT_KEY) or KV_EVENTS_REPLAY_PORT_NAME, ports)
    host = _host(address)
    return Endpoint(
        name=name,
        url=f"http://{host}:{port}",
        role=role,  # type: ignore[arg-type]
        kind=kind,
        bootstrap_port=_port(_lookup(meta, BOOTSTRAP_PORT_KEY) or BOOTSTRAP_PORT_NAME, ports),
        kv_events=f"tcp://{host}:{kv_port}" if kv_port is not None else None,
        kv_events_replay=f"tcp://{host}:{replay_port}" if None not in (kv_port, replay_port) else None,
    )


def pod_endpoints(pod: Mapping[str, Any], cfg: KubernetesDiscoveryConfig) -> dict[str, Endpoint]:
    """The pod as {uid: endpoint} if it is ready to serve, else empty."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not ip:
        return {}
    if not any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    ):
        return {}
    ports = {
        p["name"]: p["containerPort"]
        for c in (pod.get("spec") or {}).get("containers") or []
        for p in c.get("ports") or []
        if p.get("name") and isinstance(p.get("containerPort"), int)
    }
    ep = _endpoint(meta.get("name", ip), ip, meta, ports, cfg)
    return {meta.get("uid") or meta.get("name", ip): ep} if ep is not None else {}


def slice_endpoints(eps: Mapping[str, Any], cfg: KubernetesDiscoveryConfig) -> dict[str, Endpoint]:
    """An EndpointSlice's ready endpoints, keyed by their pod's uid (else slice/address)."""
    meta = eps.get("metadata") or {}
    ports = {
        p["name"]: p["port"]
        for p in eps.get("ports") or []
        if p.get("name") and isinstance(p.get("port"), int)
    }
    out: dict[str, Endpoint] = {}
    for item in eps.get("endpoints") or []:
        cond = item.get("conditions") or {}
        # A nil `ready` is an unknown state that consumers should read as ready (API reference).
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        addresses = item.get("addresses") or []
        if not addresses:
            continue
        ref = item.get("targetRef") or {}
        name = ref.get("name") or addresses[0]
        ep = _endpoint(name, addresses[0], meta, ports, cfg)
        if ep is not None:
            out[ref.get("uid") or f"{meta.get('name')}/{addresses[0]}"] = ep
    return out


class Backoff:
    """Exponential back-off with equal jitter: half the step is fixed, half random."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.failures = 0

    def next(self) -> float:
        step = min(self.max_s, self.initial_s * 2**self.failures)
        self.failures += 1
        return step / 2 + random.uniform(0, step / 2)

    def reset(self) -> None:
        self.failures = 0


class KubernetesDiscovery:
    """Keeps one pool's replicas equal to the ready pods (or EndpointSlice endpoints) a selector matches."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, membership: Membership) -> None:
        self.cfg = cfg
        self.pool = membership.pool
        self.reconciler = Reconciler(membership, cfg.drain_timeout_s)
        self.namespace = cfg.namespace
        self.resource_version: str | None = None  # where the next watch resumes; None: list first
        self._objects: dict[str, dict[str, Endpoint]] = {}  # object uid -> its ready endpoints
        self._backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self._expired_in_a_row = 0  # 410s with no event between them
        self._task: asyncio.Task[None] | None = None
        # What happened so far, for the status page and tests.
        self.stats = {"lists": 0, "watches": 0, "events": 0, "bookmarks": 0, "expired": 0, "errors": 0}
        self.synced = asyncio.Event()  # set once the first list has been applied

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kubernetes discovery {self.pool}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.reconciler.close()

    # -- connection -----------------------------------------------------------------------
    async def _api_client(self) -> ApiClient:
        from kubernetes_asyncio import client, config

        cfg = self.cfg
        sa = Path(cfg.service_account_dir)
        in_cluster = cfg.auth == "in_cluster" or (
            cfg.auth == "auto" and "KUBERNETES_SERVICE_HOST" in os.environ and (sa / "token").is_file()
        )
        conf = client.Configuration()
        if in_cluster:
            config.load_incluster_config(
                client_configuration=conf,
                token_filename=str(sa / "token"),
                cert_filename=str(sa / "ca.crt"),
            )
            if self.namespace is None and (sa / "namespace").is_file():
                self.namespace = (sa / "namespace").read_text().strip()
        else:
            await config.load_kube_config(
                config_file=cfg.kubeconfig,
                context=cfg.context,
                client_configuration=conf,
                persist_config=False,
            )
            if self.namespace is None:
                contexts, active = config.list_kube_config_contexts(cfg.kubeconfig)
                chosen = (
                    next((c for c in contexts if c["name"] == cfg.context), active) if cfg.context else active
                )
                self.namespace = ((chosen or {}).get("context") or {}).get("namespace")
        self.namespace = self.namespace or "default"
        return client.ApiClient(conf)

    def _list_call(self, api_client: ApiClient) -> Any:
        from kubernetes_asyncio import client

        if self.cfg.resource == "pods":
            return client.CoreV1Api(api_client).list_namespaced_pod
        return client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice

    # -- the reflector loop ---------------------------------------------------------------
    async def _run(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.config import ConfigException

        api_client: ApiClient | None = None
        try:
            while True:
                try:
                    if api_client is None:
                        api_client = await self._api_client()
                        log.info(
                            "pool %s: watching %s in namespace %s matching %r",
                            self.pool,
                            self.cfg.resource,
                            self.namespace,
                            self.cfg.label_selector,
                        )
                    call = self._list_call(api_client)
                    if self.resource_version is None:
                        await self._list(call)
                    await self._watch(call)
                except ApiException as exc:
                    if exc.status == 410:  # the resume point left the server's history: list again
                        self.stats["expired"] += 1
                        self.resource_version = None
                        self._expired_in_a_row += 1
                        if self._expired_in_a_row == 1:
                            log.info("pool %s: watch expired (410 Gone), listing again", self.pool)
                            continue
                        # Expired again before any event: a server in trouble, not a stale version.
                        await self._fail("watch expired again right after a list (410 Gone)")
                        continue
                    await self._fail(f"API error {exc.status} {exc.reason}")
                except ConfigException as exc:
                    await self._fail(f"no usable Kubernetes credentials: {exc}")
                except Exception as exc:  # dropped connection, malformed answer: never give up the pool
                    await self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            if api_client is not None:
                await api_client.close()

    async def _fail(self, what: str) -> None:
        self.stats["errors"] += 1
        delay = self._backoff.next()
        log.warning("pool %s: Kubernetes discovery: %s; retrying in %.1f s", self.pool, what, delay)
        await asyncio.sleep(delay)

    async def _list(self, call: Any) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        resp = await call(
            self.namespace,
            label_selector=self.cfg.label_selector,
            _preload_content=False,
            _request_timeout=self.cfg.request_timeout_s,
        )
        try:
            if not 200 <= resp.status <= 299:
                # Unloaded responses are not checked by the client: raise as it would.
                raise ApiException(status=resp.status, reason=resp.reason)
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                if size > MAX_LIST_BYTES:
                    raise ValueError(f"list response larger than {MAX_LIST_BYTES} bytes")
                chunks.append(chunk)
        finally:
            resp.release()
        data = orjson.loads(b"".join(chunks))
        self._objects = {self._key(obj): self._ready(obj) for obj in data.get("items") or []}
        self.resource_version = str(data["metadata"]["resourceVersion"])
        self.stats["lists"] += 1
        self._backoff.reset()
        self._sync()
        self.synced.set()

    async def _watch(self, call: Any) -> None:
        from kubernetes_asyncio import watch

        self.stats["watches"] += 1
        cfg = self.cfg
        # Return type "object": events stay plain dicts (no model classes built per event).
        async with watch.Watch(return_type="object") as w:
            async for event in w.stream(
                call,
                self.namespace,
                label_selector=cfg.label_selector,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=cfg.watch_timeout_s,
                # The server ends the watch after timeoutSeconds; a silent one beyond that is dead.
                _request_timeout=aiohttp.ClientTimeout(
                    sock_connect=cfg.request_timeout_s, sock_read=cfg.watch_timeout_s + cfg.request_timeout_s
                ),
            ):
                if w.resource_version is not None:
                    self.resource_version = str(w.resource_version)
                self._backoff.reset()
                self._expired_in_a_row = 0
                kind, obj = event["type"], event["raw_object"]
                if kind == "BOOKMARK":
                    self.stats["bookmarks"] += 1
                    continue
                self.stats["events"] += 1
                if kind == "DELETED":
                    self._objects.pop(self._key(obj), None)
                elif kind in ("ADDED", "MODIFIED"):
                    self._objects[self._key(obj)] = self._ready(obj)
                self._sync()

    # -- objects to endpoints -------------------------------------------------------------
    @staticmethod
    def _key(obj: Mapping[str, Any]) -> str:
        meta = obj.get("metadata") or {}
        return meta.get("uid") or meta["name"]

    def _ready(self, obj: Mapping[str, Any]) -> dict[str, Endpoint]:
        if self.cfg.resource == "pods":
            return pod_endpoints(obj, self.cfg)
        return slice_endpoints(obj, self.cfg)

    def _sync(self) -> None:
        wanted: dict[str, Endpoint] = {}
        for endpoints in self._objects.values():
            wanted.update(endpoints)
        self.reconciler.sync(wanted)

    def status(self) -> dict[str, Any]:
        return {
            "resource": self.cfg.resource,
            "namespace": self.namespace,
            "label_selector": self.cfg.label_selector,
            "resource_version": self.resource_version,
            "replicas": self.reconciler.names(),
            **self.stats,
        }
