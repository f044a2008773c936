"""OpenAI-style errors: the one shape every failure reaches a client in."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.logs import clip


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


def model_not_found(model: str) -> GatewayError:
    """404 for a model the gateway does not serve (the client's name, made safe to echo)."""
    return client_error(f"the model `{clip(model)}` does not exist", "model_not_found", "model", 404)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


# Engines' error types, as the `code` a client sees (OpenAI puts the kind of error there; its `type`
# is the family). vLLM: "Bad Request" from its request-schema (pydantic) handler, "BadRequestError",
# "NotFoundError" and the like from its serving checks, "InvalidUserInput" from the LoRA endpoints;
# SGLang uses the same names in its flat form.
_ENGINE_CODES = {
    "bad request": "invalid_request_body",
    "badrequesterror": "bad_request",
    "notfounderror": "not_found",
    "invaliduserinput": "invalid_user_input",
    "ratelimiterror": "rate_limited",
    "serviceunavailableerror": "service_unavailable",
    "notimplementederror": "not_implemented",
    "internalservererror": "internal_error",
}
# What engines say of a prompt longer than the model's context. vLLM since its renderer (0.26):
# "You passed N input tokens [characters] and requested M output tokens. However, the model's context
# length is only L tokens, ..." (vllm/renderers/params.py); before it: "This model's maximum context
# length is L tokens. However, you requested ...". SGLang (tokenizer_manager._validate_one_request):
# "The input (N tokens) is longer than the model's context length (L tokens)." and "Requested token
# count exceeds the model's maximum context length of L tokens. ...".
_CONTEXT_LENGTH_TEXTS = (
    "the model's context length is only",
    "maximum context length",
    "is longer than the model's context length",
)
# Clients that tell a context overflow from other 400s by its text alone (LiteLLM's
# ExceptionCheckers.is_error_str_context_window_exceeded, which makes it a ContextWindowExceededError
# where fallbacks to a longer-context model hang) know OpenAI's sentence and the older vLLM's, not
# vLLM 0.26's: that one gets OpenAI's sentence appended, its own text kept whole before it.
_VLLM_CONTEXT_LIMIT = re.compile(r"the model's context length is only (\d+) tokens")
_MAX_MESSAGE = 4000
_MAX_CODE = 64


def normalize_error_body(raw: bytes, status: int) -> bytes:
    """An engine's error body in the one OpenAI form, `{"error": {message, type, param, code}}`.

    `message` is the engine's own text, whole; `type` is OpenAI's family for the status
    (`invalid_request_error`, `rate_limit_error`, `upstream_error`); `code` a string: OpenAI's where
    one fits (`model_not_found`, `context_length_exceeded`), else the engine's error kind
    (`invalid_request_body` for vLLM's schema errors, `bad_request`, `not_found`, ...); `param` without
    vLLM's `body.` prefix. Shapes read: vLLM's `{"error": {...}}` (int `code`), SGLang's flat
    `{"object": "error", ...}`, FastAPI's `{"detail": "Not Found"}` and 422 `{"detail": [...]}`, and
    anything else (HTML from a proxy, plain text) as text.
    """
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        doc = None
    fields = _error_fields(doc, status) if isinstance(doc, dict) else None
    if fields is None:
        text = raw.decode(errors="replace").strip()[:_MAX_MESSAGE] or f"upstream answered {status}"
        fields = (text, None, None, None)
    message, engine_type, param, code = fields
    code = _code(status, message, engine_type, param, code)
    if code == "context_length_exceeded" and (limit := _VLLM_CONTEXT_LIMIT.search(message)):
        message += f" This model's maximum context length is {limit.group(1)} tokens."
    return error_body(message, _type_for(status), code, param)


def _error_fields(doc: dict[str, Any], status: int) -> tuple[str, str | None, str | None, Any] | None:
    """(message, the engine's type, param, the engine's code) of a JSON error body, None if it is none."""
    err = doc.get("error")
    if isinstance(err, dict) and "message" in err:
        doc = err
    elif isinstance(err, str):
        return err, None, None, None
    if "message" in doc:
        kind = doc.get("type")
        return (
            _text(doc["message"]),
            kind if isinstance(kind, str) else None,
            _param(doc.get("param")),
            doc.get("code"),
        )
    detail = doc.get("detail")
    if isinstance(detail, str):  # FastAPI's HTTPException (404 for a path the engine has no route for)
        return detail, None, None, None
    if isinstance(detail, list) and detail:  # FastAPI's RequestValidationError
        lines, param = [], None
        for item in detail[:20]:
            if not isinstance(item, dict):
                continue
            loc = [str(p) for p in item.get("loc") or () if p != "body"]
            if param is None and loc:
                param = ".".join(loc)
            lines.append(f"{'.'.join(loc) or 'body'}: {_text(item.get('msg', ''))}")
        if lines:
            return "; ".join(lines), "validation_error", param, None
    return None


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    return text[:_MAX_MESSAGE]


def _param(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    return value.removeprefix("body.")[:_MAX_CODE]


def _code(status: int, message: str, engine_type: str | None, param: str | None, code: Any) -> str | None:
    if isinstance(code, str) and code and not code.isdigit():
        return code[:_MAX_CODE]  # already a name (an OpenAI-compatible server's, or the gateway's)
    if status == 404 and param == "model":
        return "model_not_found"
    if status == 400 and any(text in message for text in _CONTEXT_LENGTH_TEXTS):
        return "context_length_exceeded"
    if engine_type is not None:
        key = engine_type.strip().lower()
        known = _ENGINE_CODES.get(key)
        if known is not None:
            return known
        snake = "".join(c if c.isalnum() else "_" for c in key).strip("_")
        return snake[:_MAX_CODE] or None
    if status == 404:
        return "not_found"
    return None


def _type_for(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "upstream_error"
    return "invalid_request_error"
