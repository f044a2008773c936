"""Property tests: random JSON in every body field the gateway reads, random header names and
values, sent over raw sockets to a real gateway (canonicalization, prefix routing, sticky routes,
priority classes all on). Whatever arrives: no 5xx from the gateway itself (an engine's own
answer is relayed, marked by x-kvgate-replica), errors in the OpenAI form, no hang, and load
counters settle back to zero.
"""

from __future__ import annotations

import asyncio
import json
import socket
import string
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from http.client import HTTPResponse
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.server import RunningGateway, start_gateway
from tests.conftest import gateway_settings
from tests.upstream_app import Upstream

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
PROPERTY = settings(
    max_examples=75,
    deadline=None,  # each example is a network round trip on a shared machine
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "x"])}, optional={"text": json_values}
    )
    | json_values,
    max_size=3,
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | json_values,
        "content": st.text(max_size=200) | content_parts | json_values,
        "name": json_values,
        "tool_calls": json_values,
        "tool_call_id": json_values,
    },
)
text_or_json = st.text(max_size=300) | json_values
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "llama"]) | json_values},
    optional={
        "messages": st.lists(message | json_values, max_size=4) | json_values,
        "prompt": text_or_json | st.lists(st.integers(0, 2**40), max_size=5),
        "tools": st.lists(json_values, max_size=3) | json_values,
        "input": text_or_json | st.lists(message, max_size=3),
        "instructions": text_or_json,
        "cache_salt": text_or_json,
        "max_tokens": json_values,
        "max_completion_tokens": json_values,
        "max_output_tokens": json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "priority": st.sampled_from(["interactive", "batch", "nope", -5, 3]) | json_values,
        "user": text_or_json,
        "kv_transfer_params": json_values,
        "request_id": json_values,
    },
)
header_names = st.sampled_from(
    [
        "x-priority",
        "x-user-id",
        "x-kvgate-no-canonicalize",
        "x-request-id",
        "content-encoding",
        "accept",
        "authorization",
        "x-vllm-priority",
        "x-sim-fault",
        "traceparent",
        "expect",
        "upgrade",
    ]
) | st.text(alphabet=string.ascii_lowercase + string.digits + "-_.!#$%&'*+^`|~", min_size=1, max_size=20)
# Anything but CR and LF (which would end the header line): controls, Latin-1, UTF-8, emoji.
header_values = st.text(alphabet=st.characters(blacklist_characters="\r\n"), max_size=40)
header_sets = st.dictionaries(header_names, header_values, max_size=6)


class LiveGateway:
    """A gateway and its upstream on an event loop in a background thread, for synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.upstream = self.run(Upstream("u0").start())
        overrides: dict[str, Any] = {
            "pool": {"canonicalize": {"enabled": True}, "policy": {"type": "prefix_affinity"}},
            "routes": [{"model": "llama", "rules": [{"pools": [{"name": "p"}], "sticky": {}}]}],
            "server": {"body_timeout_s": 2.0, "header_timeout_s": 2.0},
        }
        self.gw: RunningGateway = self.run(start_gateway(gateway_settings([self.upstream.url], **overrides)))

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def wrapped() -> Any:
            return fn()

        return self.run(wrapped())

    def settled(self) -> bool:
        rt = self.gw.runtime
        return self.call(
            lambda: (
                all(r.inflight_requests == 0 for r in rt.all_replicas())
                and all(n == 0 for n in rt.scheduler.queue_depth().values())
            )
        )

    def close(self) -> None:
        self.run(self.gw.stop())
        self.run(self.upstream.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    gw = LiveGateway()
    yield gw
    gw.close()


def send(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One request over a raw socket, header bytes exactly as given (UTF-8 for non-ASCII)."""
    lines = [f"POST {path} HTTP/1.1", "Host: gw", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("\r\n".join(lines).encode("utf-8", "surrogatepass") + b"\r\n\r\n" + body)
        resp = HTTPResponse(sock)
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def check(live: LiveGateway, status: int, headers: dict[str, str], body: bytes) -> None:
    if "x-kvgate-replica" not in headers:  # the gateway's own answer, not a relayed engine's
        assert status < 500, (status, body[:300])
        if status >= 400 and headers.get("content-type") == "application/json":
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    deadline = time.monotonic() + 5
    while not live.settled():
        assert time.monotonic() < deadline, "load counters did not settle"
        time.sleep(0.01)


@PROPERTY
@given(
    body=bodies,
    path=st.sampled_from(PATHS),
    headers=st.dictionaries(
        st.sampled_from(["x-priority", "x-user-id"]),
        st.sampled_from(["interactive", "batch", "u1", "nope"]),
        max_size=2,
    ),
)
def test_random_bodies_never_get_a_gateway_5xx(live, body, path, headers):
    raw = json.dumps(body).encode()
    status, got, answer = send(live.gw.port, path, raw, headers)
    check(live, status, got, answer)


@PROPERTY
@given(headers=header_sets, path=st.sampled_from(PATHS))
def test_random_headers_never_get_a_gateway_5xx(live, headers, path):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}).encode()
    try:
        status, got, answer = send(live.gw.port, path, raw, headers)
    except ConnectionError:  # the HTTP parser may close on what it cannot frame: a refusal, not a hang
        return
    check(live, status, got, answer)


def test_the_gateway_still_serves_after_the_properties(live):
    status, headers, _ = send(live.gw.port, "/v1/completions", b'{"model": "m", "prompt": "p"}', {})
    assert status == 200 and headers["x-kvgate-replica"] == "r0"
    assert live.settled()
