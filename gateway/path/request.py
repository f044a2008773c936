"""One inference request as it travels: what the client sent, what the gateway made of it.

The preparation step (`gateway.path.prepare`) builds it once; admission and dispatch read it.
The body is changed only through its methods, which mark it dirty, so the bytes sent to
engines are the client's own unless something changed, and then serialized once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from gateway.errors import client_error
from gateway.path.model_names import ModelRename
from gateway.path.request_record import RequestRecord
from gateway.path.sanitize import strip_body
from gateway.prompt.endpoints import Endpoint
from gateway.prompt.window import fit_window
from gateway.routing.policy import RequestFeatures
from gateway.routing.pool_router import PoolRouter


def parse_json_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    if not raw:
        raise client_error("request body is empty; expected a JSON object", "invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise client_error(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise client_error("request body must be a JSON object", "invalid_json")
    # Arrays and objects nested this deep are no API's shape; past it the gateway could not
    # re-serialize the body (orjson stops at 255 levels).
    if raw.count(b"[") + raw.count(b"{") > max_depth and nesting_exceeds(body, max_depth):
        raise client_error(f"request body nests JSON deeper than {max_depth} levels", "invalid_json")
    return body


def nesting_exceeds(doc: Any, limit: int) -> bool:
    """Whether arrays and objects in `doc` nest more than `limit` deep (the document itself is 1)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


@dataclass(slots=True, eq=False)
class InferenceRequest:
    """Filled by the preparation step, in this order: the client's part (`path`, `headers`, `raw`,
    `tenant`, `record` with the request ids) and the parsed `body`; the pool's `router` and the
    answer's `rename` once the model is resolved; `features` (prompt tokens and block hashes, then
    the priority class and level) once the prompt is canonicalized and measured; `trimmed` when the
    prompt window cut it."""

    path: str  # the URL path, e.g. /v1/chat/completions (engines are sent the same)
    headers: Mapping[str, str]  # the client's
    raw: bytes  # the body as the client sent it (decoded from its content coding)
    body: dict[str, Any]
    tenant: str | None
    record: RequestRecord  # request ids, and what happened, for the observers
    router: PoolRouter
    rename: ModelRename | None = None  # the client's model name back in the answer (None: as it is)
    features: RequestFeatures = field(init=False)
    dirty: bool = False  # the body differs from `raw`
    trimmed: bool = False  # the prompt window dropped turns
    _payload: bytes | None = None

    @property
    def endpoint(self) -> Endpoint:
        # The record names any endpoint (/tokenize's too); an inference request's comes from the
        # endpoint table (gateway.prompt.endpoints).
        return cast("Endpoint", self.record.endpoint)

    # -- the body's changes: each marks it dirty ----------------------------------------------
    def strip(self, allowed: frozenset[str]) -> list[str]:
        """Remove the body fields a client may not send engines (but `allowed`); the ones removed."""
        removed = strip_body(self.body, allowed)
        if removed:
            self._changed()
        return removed

    def set(self, key: str, value: Any) -> None:
        self.body[key] = value
        self._changed()

    def drop(self, key: str) -> None:
        if key in self.body:
            del self.body[key]
            self._changed()

    def replace(self, body: dict[str, Any]) -> None:
        """A rewritten body (canonicalization makes a new one)."""
        self.body = body
        self._changed()

    def trim(self, limit: int) -> bool:
        """Drop the conversation's oldest turns until the prompt fits `limit` tokens (the prompt
        window); False, the body unchanged, when it cannot fit."""
        if fit_window(self.body, self.endpoint, limit) is None:
            return False
        self.trimmed = True
        self._changed()
        return True

    def _changed(self) -> None:
        self.dirty = True
        self._payload = None

    def payload(self) -> bytes:
        """The bytes to send engines: the client's own unless the body changed."""
        if not self.dirty:
            return self.raw
        if self._payload is None:
            self._payload = orjson.dumps(self.body)
        return self._payload
