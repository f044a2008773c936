"""The control plane's listener: every admin route behind the key (checked in constant time), its
OpenAPI schema with the models, errors in the OpenAI form, the docs page working offline, the data
plane no longer answering /admin, and both listeners closing on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.cli import main as cli_main
from gateway.config import ConfigError
from gateway.control.admin import MAX_BODY_BYTES
from gateway.server import ListenError, RunningGateway, start_gateway
from tests.browser import chromium, needs_chromium
from tests.conftest import free_port, gateway_settings, wait_until
from tests.rawhttp import read_response
from tests.routing.test_rollout import rollout_settings

KEY = "adm-7f3a-control-secret"
AUTH = {"authorization": f"Bearer {KEY}"}
PARAMS = {"model": "llama", "pool": "stable", "replica": "stable-0"}
ROUTES = {
    ("GET", "/admin/routes"),
    ("PUT", "/admin/routes/{model}/weights"),
    ("GET", "/admin/rollouts"),
    ("GET", "/admin/pools"),
    ("POST", "/admin/pools/{pool}/replicas"),
    ("DELETE", "/admin/pools/{pool}/replicas/{replica}"),
    ("POST", "/admin/pools/{pool}/replicas/{replica}/drain"),
    ("POST", "/admin/pools/{pool}/replicas/{replica}/undrain"),
    ("POST", "/admin/reload"),
    ("GET", "/admin/audit"),
    ("GET", "/admin/state"),
}


@pytest.fixture
async def gw(upstreams, gateway) -> RunningGateway:
    s, c = await upstreams(2)
    return await gateway(rollout_settings(s.url, c.url, 90, 10, control={"admin_key": KEY}))


@pytest.fixture
async def control(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    assert gw.control_url is not None
    async with httpx.AsyncClient(base_url=gw.control_url) as client:
        yield client


def operations(schema: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    return body["error"]


async def test_schema_lists_every_admin_route_with_its_models(control: httpx.AsyncClient) -> None:
    r = await control.get("/openapi.json")  # open: it describes the API and holds no data
    assert r.status_code == 200
    schema = r.json()
    assert operations(schema) == ROUTES
    assert schema["components"]["securitySchemes"] == {
        "adminKey": {"type": "http", "scheme": "bearer", "description": "control.admin_key"}
    }
    assert schema["security"] == [{"adminKey": []}]

    def ref(op: dict[str, Any], status: str) -> str:
        return op["responses"][status]["content"]["application/json"]["schema"]["$ref"].rpartition("/")[2]

    paths = schema["paths"]
    expected = {
        ("get", "/admin/routes", "200"): "RoutesView",
        ("put", "/admin/routes/{model}/weights", "200"): "WeightsChange",
        ("get", "/admin/rollouts", "200"): "RolloutsView",
        ("get", "/admin/pools", "200"): "PoolsView",
        ("post", "/admin/pools/{pool}/replicas", "201"): "ReplicaView",
        ("delete", "/admin/pools/{pool}/replicas/{replica}", "200"): "RemovedReplica",
        ("post", "/admin/pools/{pool}/replicas/{replica}/drain", "200"): "ReplicaView",
        ("post", "/admin/reload", "200"): "ReloadResult",
        ("get", "/admin/audit", "200"): "AuditView",
        ("get", "/admin/state", "200"): "StateStatus",
    }
    for (method, path, status), model in expected.items():
        assert ref(paths[path][method], status) == model, (method, path)
    for path, ops in paths.items():
        for method, op in ops.items():
            # Every error is the OpenAI form; FastAPI's 422 validation body is never sent.
            assert ref(op, "4XX") == "ErrorResponse" and "422" not in op["responses"], (method, path)
    body = paths["/admin/routes/{model}/weights"]["put"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/WeightsUpdate")
    body = paths["/admin/pools/{pool}/replicas"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/EndpointConfig")
    models = schema["components"]["schemas"]
    assert models["WeightsUpdate"]["properties"]["weights"]["minProperties"] == 1
    assert set(models["ReplicaView"]["required"]) >= {"name", "url", "healthy", "draining", "circuit"}
    assert set(models["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}


async def test_every_route_needs_the_key_checked_in_constant_time(
    gw: RunningGateway, control: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr("gateway.http.auth.hmac.compare_digest", compare_digest)
    wrong = [
        {},
        {"authorization": "Bearer " + "x" * len(KEY)},  # as long as the key
        {"authorization": "Bearer " + KEY[:-1]},  # the key's prefix
        {"authorization": f"Basic {KEY}"},  # the key, in another scheme
    ]
    async with httpx.AsyncClient(base_url=gw.url) as data_plane:
        for method, template in sorted(ROUTES):
            path = template.format(**PARAMS)
            body = {"weights": {"canary": 0}} if method == "PUT" else None
            for headers in wrong:
                r = await control.request(method, path, json=body, headers=headers)
                assert_openai_error(r, 401, "invalid_admin_key")
            # The data plane no longer answers any of it, key or not.
            r = await data_plane.request(method, path, json=body, headers=AUTH)
            assert_openai_error(r, 404, "not_found")
    # Each wrong bearer key went through hmac.compare_digest against the admin key.
    tried = {a for a, b in compared if b == KEY.encode()}
    assert tried == {b"x" * len(KEY), KEY[:-1].encode()}
    assert len(compared) == 2 * len(ROUTES)
    # Nothing the unauthenticated calls asked for happened.
    assert not gw.runtime.audit.changes
    assert gw.runtime.rollouts.weights("llama") == {"stable": 90.0, "canary": 10.0}
    assert not gw.runtime.pools["stable"].replicas["stable-0"].draining
    # An unknown path needs the key too, before it is found missing.
    assert_openai_error(await control.get("/admin/nope"), 401, "invalid_admin_key")
    assert_openai_error(await control.get("/nope", headers=AUTH), 404, "not_found")


async def test_routes_and_rollouts_show_rules_as_the_router_has_them(upstreams, gateway) -> None:
    (up,) = await upstreams(1)
    pool = {"model": "m", "lora": {"adapters": [{"name": "sql"}]}}
    routes = [
        {"model": "llama", "rules": [{"pools": [{"name": "p"}]}]},
        {
            "model": "assistant",
            "rules": [
                {"match": {"headers": {"x-canary": "1"}}, "pools": [{"name": "p", "adapter": "sql"}]},
                {"pools": [{"name": "p", "weight": 50}], "sticky": {"salt": "s"}},
            ],
            "rewrite_model": False,
        },
    ]
    gw = await gateway(gateway_settings([up.url], pool=pool, routes=routes, control={"admin_key": KEY}))
    async with httpx.AsyncClient(base_url=gw.control_url, headers=AUTH) as client:
        shown = (await client.get("/admin/routes")).json()["routes"]
        rollouts = (await client.get("/admin/rollouts")).json()["routes"]
    assert shown == gw.runtime.rollouts.describe()  # the same keys: optional ones only when set
    assert "adapter" not in shown["llama"][0]["pools"][0] and shown["assistant"][0]["rewrite_model"] is False
    assert rollouts["assistant"]["rules"] == shown["assistant"]
    assert rollouts["assistant"]["variants"]["p"]["weight"] == 50.0


async def test_errors_come_in_the_openai_form(gw: RunningGateway, control: httpx.AsyncClient) -> None:
    weights = "/admin/routes/llama/weights"
    err = assert_openai_error(
        await control.put(weights, json={"weights": {"canary": "x"}}, headers=AUTH), 400, "invalid_weights"
    )
    assert err["param"] == "weights.canary" and err["type"] == "invalid_request_error"
    for bad in ({"weights": {"canary": True}}, {"weights": {}}, {"weights": {"stable": 0, "canary": 0}}):
        assert_openai_error(await control.put(weights, json=bad, headers=AUTH), 400, "invalid_weights")
    assert_openai_error(
        await control.put(weights, json={"weights": {"canary": 1}, "rule": "0"}, headers=AUTH),
        400,
        "invalid_rule",
    )
    err = assert_openai_error(
        await control.put(weights, json={"weights": {"canary": 1}, "wieght": 1}, headers=AUTH),
        400,
        "unknown_field",
    )
    assert err["param"] == "wieght"
    json_auth = {**AUTH, "content-type": "application/json"}
    assert_openai_error(
        await control.put(weights, content=b'{"weights": ', headers=json_auth), 400, "invalid_json"
    )
    assert_openai_error(
        await control.put(weights, content=b"[" * 5000, headers=json_auth), 400, "invalid_json"
    )
    huge = b'{"weights": {"canary": 1}, "pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
    assert_openai_error(await control.put(weights, content=huge, headers=json_auth), 413, "request_too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the bound holds as it arrives
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b" " * 4096

    assert_openai_error(
        await control.put(weights, content=chunked(), headers=json_auth), 413, "request_too_large"
    )
    assert_openai_error(
        await control.put("/admin/routes/nope/weights", json={"weights": {"a": 1}}, headers=AUTH),
        404,
        "route_not_found",
    )
    replicas = "/admin/pools/stable/replicas"
    err = assert_openai_error(
        await control.post(replicas, json={"url": "ftp://x"}, headers=AUTH), 400, "invalid_url"
    )
    assert err["param"] == "url"
    assert_openai_error(
        await control.post("/admin/pools/nope/replicas", json={"url": "http://127.0.0.1:1"}, headers=AUTH),
        404,
        "pool_not_found",
    )
    assert_openai_error(await control.post(replicas + "/zz/drain", headers=AUTH), 404, "replica_not_found")
    r = await control.delete("/admin/routes", headers=AUTH)
    assert_openai_error(r, 405, "method_not_allowed")
    # None of it changed anything, and the API still serves.
    assert not gw.runtime.audit.changes
    r = await control.put(weights, json={"weights": {"canary": 0}}, headers=AUTH)
    assert r.status_code == 200 and r.json()["weights"] == {"stable": 90.0, "canary": 0.0}


async def test_docs_page_loads_offline(control: httpx.AsyncClient) -> None:
    r = await control.get("/docs")  # open, like the schema it shows
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    html = r.text
    assert not re.search(r"https?://|//[a-z]", html), "nothing from another origin"
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert {a.rpartition("/")[2] for a in assets} == {"swagger-ui.css", "favicon.png", "swagger-ui-bundle.js"}
    for asset in assets:
        got = await control.get(asset)
        assert got.status_code == 200 and len(got.content) > 1000, asset
    assert b"SwaggerUIBundle" in (await control.get(assets[-1])).content
    assert "url: '/openapi.json'" in html and '"validatorUrl": null' in html


@needs_chromium
async def test_docs_page_renders_every_route_in_chromium(gw: RunningGateway, tmp_path: Path) -> None:
    # The machine has no internet: what renders came from the gateway alone, under its CSP.
    dom = await chromium(tmp_path, f"{gw.control_url}/docs", "--dump-dom")
    shown = set(re.findall(r'data-path="([^"]+)"', dom))
    assert shown == {path for _, path in ROUTES}, shown


async def test_shutdown_closes_both_listeners(upstreams) -> None:
    (up,) = await upstreams(1)
    gw = await start_gateway(gateway_settings([up.url], control={"admin_key": KEY}))
    assert gw.control is not None
    ports = (gw.port, gw.control.port)
    # A keep-alive connection to the control plane, idle when the gateway stops.
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.control.port)
    writer.write(f"GET /admin/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await asyncio.wait_for(gw.stop(), 10)
    rest = await asyncio.wait_for(reader.read(), 5)  # the server closed it: EOF after the body
    assert rest.endswith(b'"connected":true}')
    writer.close()
    for port in ports:
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)


async def test_a_taken_control_port_fails_the_start(upstreams) -> None:
    (up,) = await upstreams(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port, data_port = taken.getsockname()[1], free_port()
        settings = gateway_settings(
            [up.url], server={"port": data_port}, control={"admin_key": KEY, "port": port}
        )
        with pytest.raises(ListenError, match=f"control.host:control.port 127.0.0.1:{port}"):
            await start_gateway(settings)
    with socket.socket() as again:  # the data plane's port was given back
        again.bind(("127.0.0.1", data_port))


async def test_deprecated_server_admin_key_still_works(upstreams, gateway, caplog, capsys, tmp_path) -> None:
    (up,) = await upstreams(1)
    settings = gateway_settings([up.url], server={"admin_key": KEY})
    assert settings.control.admin_key == KEY
    gw = await gateway(settings)
    assert "server.admin_key is deprecated: use control.admin_key" in caplog.text
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(settings.model_dump(mode="json", include={"server", "pools"})))
    assert cli_main(["check-config", str(path)]) == 0
    assert "warning: server.admin_key is deprecated" in capsys.readouterr().err
    async with httpx.AsyncClient(base_url=gw.control_url) as client:
        assert (await client.get("/admin/pools", headers=AUTH)).status_code == 200
    with pytest.raises(ConfigError, match=r"server\.admin_key .* and control\.admin_key differ"):
        gateway_settings([up.url], server={"admin_key": KEY}, control={"admin_key": "other"})


async def test_silent_connections_are_bounded_and_closed(upstreams, gateway) -> None:
    """A flood of connections that never send a request cannot hold the control port: at
    `max_connections` a newcomer closes the connection that has waited longest for a request, and
    silent connections are closed after the idle timeout, first request or not."""
    s, c = await upstreams(2)
    control_cfg = {"admin_key": KEY, "max_connections": 4, "idle_timeout_s": 0.5}
    gw = await gateway(rollout_settings(s.url, c.url, 90, 10, control=control_cfg))
    assert gw.control_url is not None
    host, port = gw.control_url.removeprefix("http://").split(":")
    silent = [await asyncio.open_connection(host, int(port)) for _ in range(8)]
    try:
        async with httpx.AsyncClient(base_url=gw.control_url) as client:
            r = await client.get("/admin/routes", headers=AUTH)
            assert r.status_code == 200  # the flood displaced its own oldest, not the operator
            closed = await asyncio.wait_for(
                asyncio.gather(*(reader.read() for reader, _ in silent)), timeout=10
            )
            assert closed == [b""] * 8  # each closed by the server, without a byte
            r = await client.get("/admin/routes", headers=AUTH)
            assert r.status_code == 200
    finally:
        for _, writer in silent:
            writer.close()


async def _control_gateway(upstreams, gateway, **control: Any) -> tuple[RunningGateway, str, int]:
    s, c = await upstreams(2)
    gw = await gateway(rollout_settings(s.url, c.url, 90, 10, control={"admin_key": KEY, **control}))
    assert gw.control_url is not None
    host, port = gw.control_url.removeprefix("http://").split(":")
    return gw, host, int(port)


async def test_slowloris_does_not_lock_the_operator_out(upstreams, gateway) -> None:
    """Issue 26: 40 connections each sending a head byte every 2 s held every slot, so every admin
    call got 503 for as long as they went on: each byte restarted the idle timer."""
    gw, host, port = await _control_gateway(
        upstreams, gateway, max_connections=8, idle_timeout_s=0.5, header_timeout_s=1.0
    )
    head = b"GET /admin/routes HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    trickling = [await asyncio.open_connection(host, port) for _ in range(12)]

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        for i in range(len(head) - 2):  # never the end of the head: a byte every 0.2 s
            writer.write(head[i : i + 1])
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(reader.read(), 0.2)  # b"": closed by the gateway
        return b"still open"

    flood = [asyncio.create_task(trickle(r, w)) for r, w in trickling]
    try:
        async with httpx.AsyncClient(base_url=gw.control_url) as client:
            for _ in range(3):
                r = await client.get("/admin/routes", headers=AUTH)
                assert r.status_code == 200, r.text
        assert await asyncio.wait_for(asyncio.gather(*flood), 30) == [b""] * 12  # every one cut off
    finally:
        for task in flood:
            task.cancel()
        for _, writer in trickling:
            writer.close()


async def test_connections_per_address_are_capped(upstreams, gateway) -> None:
    gw, host, port = await _control_gateway(upstreams, gateway, max_connections_per_address=3)
    assert gw.control is not None
    slots = gw.control.slots
    busy = []
    for _ in range(3):  # requests in progress: bodies promised and never sent
        reader, writer = await asyncio.open_connection(host, port)
        auth = b"Authorization: Bearer " + KEY.encode()
        writer.write(b"POST /admin/reload HTTP/1.1\r\nHost: c\r\n" + auth + b"\r\nContent-Length: 10\r\n\r\n")
        busy.append((reader, writer))
    await wait_until(lambda: slots.by_address == {"127.0.0.1": 3} and not slots.waiting, what="3 busy")
    try:
        refused, _ = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(refused.read(), 5) == b""  # closed at once: none of it waiting
    finally:
        for _, writer in busy:
            writer.close()


async def test_a_trickled_body_gets_408_and_frees_its_slot(upstreams, gateway) -> None:
    """A key holder's bodies trickled a byte at a time held the address's slots for as long as
    they went on (uvicorn has no timer during a request), so every other admin call from that
    address failed; `control.body_deadline_s` ends each with a 408."""
    gw, host, port = await _control_gateway(
        upstreams, gateway, max_connections_per_address=2, body_deadline_s=1.0
    )
    head = b"PUT /admin/routes/llama/weights HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer " + KEY.encode()
    body = b'{"weights": {"canary": 0}}' + b" " * 200  # ~40 s at a byte every 0.2 s

    async def trickle() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head + b"\r\nContent-Length: %d\r\n\r\n" % len(body))
            for i in range(len(body)):
                writer.write(body[i : i + 1])
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(reader.read(), 0.2)  # the answer, then closed
            return b"whole body sent, no answer"
        finally:
            writer.close()

    answers = await asyncio.gather(trickle(), trickle())
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b'"code":"request_timeout"' in answer and b"control.body_deadline_s (1 s)" in answer
    assert gw.control is not None
    await wait_until(lambda: not gw.control.slots.by_address, what="the trickling connections closed")  # type: ignore[union-attr]
    async with httpx.AsyncClient(base_url=gw.control_url) as client:
        r = await client.put("/admin/routes/llama/weights", json={"weights": {"canary": 0}}, headers=AUTH)
        assert r.status_code == 200, r.text  # a whole body in time is served as before


@pytest.mark.parametrize("pieces", [1, 8], ids=["whole", "in-pieces"])
async def test_request_heads_are_bounded_to_16_kib(upstreams, gateway, pieces: int) -> None:
    """Issue 26: a 20 kB head was accepted (h11 bounds only a head still incomplete)."""
    gw, host, port = await _control_gateway(upstreams, gateway)
    head = b"GET /admin/routes HTTP/1.1\r\nHost: c\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n"
    reader, writer = await asyncio.open_connection(host, port)
    try:
        size = -(-len(head) // pieces)
        for i in range(0, len(head), size):
            writer.write(head[i : i + size])
            await writer.drain()
        answer = await asyncio.wait_for(read_response(reader), 5)
    finally:
        writer.close()
    assert answer.status == 431
    assert answer.json()["error"]["code"] == "request_header_too_large"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=gw.control_url) as client:
        assert (await client.get("/admin/routes", headers=AUTH)).status_code == 200
