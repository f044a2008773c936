"""A Kubernetes API server for tests: pods and EndpointSlices, list and watch, on a loopback socket.

It implements the parts of the API a list/watch client relies on, as the API concepts page
describes them (kubernetes.io/docs/reference/using-api/api-concepts):

- one resourceVersion counter for every change (like etcd's revision); each object carries the
  version of its last change, a list carries the version it was taken at;
- list: `GET .../namespaces/NS/pods` (and `/apis/discovery.k8s.io/v1/.../endpointslices`) with
  `labelSelector` (equality and set-based requirements); a `resourceVersion` newer than the
  server's answers 504 "Too large resource version";
- watch (`watch=true`): a chunked stream of JSON lines `{"type", "object"}`; without
  `resourceVersion` (or "0") it starts with synthetic ADDED events for the current objects, with one
  it replays every change after that version; a version older than the retained history gets an
  ERROR event carrying a 410 `Expired` Status (as the watch cache does), or a plain HTTP 410 when
  `gone_as_status`; through a label selector an object that stops matching arrives as DELETED and
  one that starts matching as ADDED; `allowWatchBookmarks=true` adds BOOKMARK events (only
  `metadata.resourceVersion` set, the latest version) every `bookmark_interval_s`;
  `timeoutSeconds` ends the stream cleanly;
- bearer-token auth (401 Status otherwise), and the test's levers: `compact()` drops the history,
  `drop_watches()` cuts every open watch mid-stream (no terminating chunk), `fail_next` answers the
  next requests with an error status, `expire_every_watch` answers every watch from a version 410.
Objects are created, changed and deleted by the test through methods, not through the API.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web

RESOURCES = {
    "pods": ("v1", "Pod"),
    "endpointslices": ("discovery.k8s.io/v1", "EndpointSlice"),
}
_REQUIREMENT = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def parse_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A label selector as the API server reads it; ValueError when it is malformed."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    checks: list[Callable[[dict[str, str]], bool]] = []
    for part in parts:
        m = _REQUIREMENT.match(part)
        if m is None:
            raise ValueError(f"unable to parse requirement: {part!r}")
        neg, key, op, value, set_op, values = m.groups()
        if neg and (op or set_op):
            raise ValueError(f"unable to parse requirement: {part!r}")
        if op in ("=", "=="):
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif op == "!=":
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif set_op:
            vals = {v.strip() for v in values.split(",")}
            if set_op == "in":
                checks.append(lambda labels, k=key, vs=vals: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=vals: labels.get(k) not in vs)
        elif neg:
            checks.append(lambda labels, k=key: k not in labels)
        else:
            checks.append(lambda labels, k=key: k in labels)
    return lambda labels: all(check(labels) for check in checks)


def flag(value: str | None) -> bool:
    """A boolean query parameter as the API server parses it (Go's strconv.ParseBool)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass(slots=True)
class Change:
    rv: int
    resource: str
    namespace: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    prev: dict[str, Any] | None  # the object before the change (None when added)


@dataclass(slots=True)
class _Watch:
    resource: str
    namespace: str
    matches: Callable[[dict[str, str]], bool]
    request: web.Request
    queue: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    dropped: asyncio.Event = field(default_factory=asyncio.Event)


class KubeAPI:
    def __init__(self, token: str = "test-token", bookmark_interval_s: float | None = None) -> None:
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.gone_as_status = False
        self.expire_every_watch = False  # a server in trouble: every watch from a version gets 410
        self.fail_next: list[int] = []
        self.rv = 100
        self.compacted_rv = 0  # changes at or below this version are no longer retained
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[Change] = []
        self.watches: list[_Watch] = []
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, query) of every API request
        self._uids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, ssl_context: ssl.SSLContext | None = None) -> KubeAPI:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._handle("pods"))
        app.router.add_get(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._handle("endpointslices")
        )
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path, namespace: str | None = "kv", token: str | None = None) -> Path:
        context: dict[str, Any] = {"cluster": "test", "user": "tester"}
        if namespace:
            context["namespace"] = namespace
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": token or self.token}}],
                    "contexts": [{"name": "test", "context": context}],
                    "current-context": "test",
                }
            )
        )
        return path

    # -- the test's levers ----------------------------------------------------------------
    def put(self, resource: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (as a controller or the kubelet would)."""
        api_version, kind = RESOURCES[resource]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        key = (resource, namespace, meta["name"])
        prev = self.objects.get(key)
        self.rv += 1
        meta.update(namespace=namespace, resourceVersion=str(self.rv))
        meta["uid"] = prev["metadata"]["uid"] if prev else f"uid-{next(self._uids):06d}"
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        obj.update(apiVersion=api_version, kind=kind)
        self.objects[key] = obj
        self._record(Change(self.rv, resource, namespace, "MODIFIED" if prev else "ADDED", obj, prev))
        return obj

    def delete(self, resource: str, namespace: str, name: str) -> None:
        prev = self.objects.pop((resource, namespace, name))
        self.rv += 1
        obj = copy.deepcopy(prev)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record(Change(self.rv, resource, namespace, "DELETED", obj, prev))

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.objects[(resource, namespace, name)])

    def compact(self) -> None:
        """Forget every change so far (etcd compaction): a watch from an older version gets 410."""
        self.compacted_rv = self.rv
        self.history.clear()

    def drop_watches(self) -> int:
        """Cut every open watch mid-stream, as a dying API server or a load balancer would."""
        for w in self.watches:
            w.dropped.set()
            if w.request.transport is not None:
                w.request.transport.abort()
        return len(self.watches)

    def watch_requests(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if flag(q.get("watch"))]

    def list_requests(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if not flag(q.get("watch"))]

    # -- internals ------------------------------------------------------------------------
    def _record(self, change: Change) -> None:
        self.history.append(change)
        for w in self.watches:
            if w.resource == change.resource and w.namespace == change.namespace:
                event = self._filtered(change, w.matches)
                if event is not None:
                    w.queue.put_nowait(event)

    @staticmethod
    def _filtered(change: Change, matches: Callable[[dict[str, str]], bool]) -> dict[str, Any] | None:
        """The change as a watcher with this selector sees it (None: not at all)."""
        now = change.type != "DELETED" and matches(change.obj["metadata"].get("labels") or {})
        before = change.prev is not None and matches(change.prev["metadata"].get("labels") or {})
        if now and before:
            kind = change.type
        elif now:
            kind = "ADDED"
        elif before:
            kind = "DELETED"
        else:
            return None
        return {"type": kind, "object": change.obj}

    def _handle(self, resource: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            query = dict(request.query)
            self.requests.append((request.path, query))
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
            if self.fail_next:
                code = self.fail_next.pop(0)
                return web.json_response(status(code, "InternalError", f"injected {code}"), status=code)
            try:
                matches = parse_selector(query.get("labelSelector", ""))
            except ValueError as exc:
                return web.json_response(status(400, "BadRequest", str(exc)), status=400)
            ns = request.match_info["ns"]
            if flag(query.get("watch")):
                return await self._watch(request, resource, ns, matches, query)
            rv = query.get("resourceVersion")
            if rv not in (None, "", "0") and int(rv) > self.rv:
                return web.json_response(
                    status(504, "Timeout", f"Too large resource version: {rv}, current: {self.rv}"),
                    status=504,
                )
            api_version, kind = RESOURCES[resource]
            items = [
                obj
                for (res, obj_ns, _), obj in sorted(self.objects.items())
                if res == resource and obj_ns == ns and matches(obj["metadata"].get("labels") or {})
            ]
            body = {
                "kind": f"{kind}List",
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
            return web.Response(body=orjson.dumps(body), content_type="application/json")

        return handler

    async def _watch(
        self,
        request: web.Request,
        resource: str,
        ns: str,
        matches: Callable[[dict[str, str]], bool],
        query: dict[str, str],
    ) -> web.StreamResponse:
        rv = query.get("resourceVersion")
        gone = rv not in (None, "", "0") and (int(rv) < self.compacted_rv or self.expire_every_watch)
        expired = status(410, "Expired", f"too old resource version: {rv} ({self.compacted_rv + 1})")
        if gone and self.gone_as_status:
            return web.json_response(expired, status=410)
        w = _Watch(resource, ns, matches, request)
        # Queue the starting state before registering for live changes: nothing runs in between.
        if gone:
            w.queue.put_nowait({"type": "ERROR", "object": expired})
        elif rv in (None, "", "0"):
            for (res, obj_ns, _), obj in sorted(self.objects.items()):
                if res == resource and obj_ns == ns and matches(obj["metadata"].get("labels") or {}):
                    w.queue.put_nowait({"type": "ADDED", "object": obj})
        else:
            for change in self.history:
                if change.rv > int(rv) and change.resource == resource and change.namespace == ns:
                    event = self._filtered(change, matches)
                    if event is not None:
                        w.queue.put_nowait(event)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        self.watches.append(w)
        loop = asyncio.get_running_loop()
        end = loop.time() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = flag(query.get("allowWatchBookmarks")) and self.bookmark_interval_s is not None
        next_bookmark = loop.time() + (self.bookmark_interval_s or 0)
        api_version, kind = RESOURCES[resource]
        try:
            while not w.dropped.is_set():
                now = loop.time()
                if now >= end:
                    break
                wake = min(end, next_bookmark) if bookmarks else end
                try:
                    event = await asyncio.wait_for(w.queue.get(), timeout=max(0.0, wake - now))
                except TimeoutError:
                    if not bookmarks or loop.time() < next_bookmark:
                        continue
                    next_bookmark = loop.time() + (self.bookmark_interval_s or 0)
                    event = {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": kind,
                            "apiVersion": api_version,
                            "metadata": {"resourceVersion": str(self.rv)},
                        },
                    }
                await resp.write(orjson.dumps(event) + b"\n")
                if event["type"] == "ERROR":
                    break
            if not w.dropped.is_set():
                await resp.write_eof()
        except (ConnectionResetError, RuntimeError):  # dropped (transport aborted) or the client left
            pass
        finally:
            self.watches.remove(w)
        return resp

    # -- object builders ------------------------------------------------------------------
    def put_pod(
        self,
        namespace: str,
        name: str,
        port: int,
        *,
        labels: dict[str, str],
        ready: bool = True,
        ip: str = "127.0.0.1",
        annotations: dict[str, str] | None = None,
        ports: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """A running engine pod; `ready` sets its Ready condition (the kubelet's readiness probe)."""
        container_ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        container_ports += [
            {"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (ports or {}).items()
        ]
        return self.put(
            "pods",
            namespace,
            {
                "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
                "spec": {"containers": [{"name": "engine", "image": "kvgate-sim", "ports": container_ports}]},
                "status": {
                    "phase": "Running",
                    "podIP": ip,
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                },
            },
        )

    def set_pod_ready(self, namespace: str, name: str, ready: bool) -> None:
        pod = self.get("pods", namespace, name)
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self.put("pods", namespace, pod)

    def terminate_pod(self, namespace: str, name: str) -> None:
        """`kubectl delete pod`: first the deletion timestamp (graceful termination), later `delete`."""
        pod = self.get("pods", namespace, name)
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
        self.put("pods", namespace, pod)
