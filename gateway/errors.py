"""OpenAI-style errors: the one shape every failure reaches a client in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson


class GatewayError(Exception):
    """An error with the status and OpenAI error fields a client should see."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> None:
        """`body`, when given, is an already OpenAI-shaped error (an engine's, relayed as is)."""
        super().__init__(message)
        self._body = body
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        if self._body is not None:
            return self._body
        return error_body(self.message, self.type, self.code, self.param)


def client_error(message: str, code: str, param: str | None = None, status: int = 400) -> GatewayError:
    """The client's mistake (400 unless said otherwise)."""
    return GatewayError(status, message, "invalid_request_error", code, param)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def normalize_error_body(raw: bytes, status: int) -> bytes:
    """Return an upstream error body in the OpenAI form.

    vLLM already answers `{"error": {...}}`; SGLang's non-streaming errors are flat
    (`{"object": "error", "message": ...}`); anything else (HTML from a proxy, plain text)
    is wrapped so a client's SDK can always parse it.
    """
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and "message" in err:
            return orjson.dumps(
                {
                    "error": {
                        "message": str(err.get("message")),
                        "type": err.get("type") or _type_for(status),
                        "param": err.get("param"),
                        "code": err.get("code"),
                    }
                }
            )
        if "message" in doc:
            code = doc.get("code")
            return error_body(
                str(doc["message"]),
                str(doc.get("type") or _type_for(status)),
                None if code is None else str(code),
                doc.get("param"),
            )
        if isinstance(err, str):
            return error_body(err, _type_for(status))
    text = raw.decode(errors="replace").strip()[:500] or f"upstream answered {status}"
    return error_body(text, _type_for(status))


def _type_for(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "upstream_error"
    return "invalid_request_error"
