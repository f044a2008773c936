"""Every engine error shape kvgate meets, in the one OpenAI form, the engine's message intact."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import normalize_error_body


def _vllm(message: str, type_: str, param: str | None, code: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


SCHEMA_TEXT = "1 validation error:\n  {'type': 'float_parsing', 'loc': 'body.temperature'}"
VLLM_SCHEMA = _vllm(SCHEMA_TEXT, "Bad Request", "body.temperature", 400)
VLLM_MODEL = _vllm("The model `nope` does not exist.", "NotFoundError", "model", 404)
VLLM_LENGTH = _vllm(
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens",
    "BadRequestError",
    "input_tokens",
    400,
)
# vLLM 0.26+ (vllm/renderers/params.py), by token count and by character count.
VLLM_TOKENS = _vllm(
    "You passed 10 input tokens and requested 4090 output tokens. However, the model's context length "
    "is only 4096 tokens, resulting in a maximum input length of 6 tokens. Please reduce the length of "
    "the input prompt. (parameter=input_tokens, value=10)",
    "BadRequestError",
    "input_tokens",
    400,
)
VLLM_CHARS = _vllm(
    "You passed 90000 input characters and requested 0 output tokens. However, the model's context "
    "length is only 4096 tokens, resulting in a maximum input length of 4096 tokens (at most 81920 "
    "characters). Please reduce the length of the input prompt. (parameter=input_text, value=90000)",
    "BadRequestError",
    "input_text",
    400,
)
# What vLLM 0.26's context overflows get after their own text: OpenAI's sentence, which clients that
# match on text (LiteLLM) know; the older vLLM's and SGLang's texts are known to them already.
OPENAI_CONTEXT = " This model's maximum context length is 4096 tokens."
# SGLang (tokenizer_manager._validate_one_request), in its flat form: the prompt alone, and with max_tokens.
SGLANG_INPUT = orjson.dumps(
    {
        "object": "error",
        "message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
)
SGLANG_TOTAL = orjson.dumps(
    {
        "object": "error",
        "message": "Requested token count exceeds the model's maximum context length of 4096 tokens. You "
        "requested a total of 5000 tokens: 4000 tokens from the input messages and 1000 tokens for the "
        "completion. Please reduce the number of tokens in the input messages or the completion to fit "
        "within the limit.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
)
LORA_INPUT = _vllm("The lora adapter 'sql' has already been loaded.", "InvalidUserInput", None, 400)
SGLANG_FLAT = orjson.dumps(
    {
        "object": "error",
        "message": "bad sampling params",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
)
FASTAPI_404 = b'{"detail":"Not Found"}'
FASTAPI_422 = orjson.dumps(
    {
        "detail": [
            {"type": "missing", "loc": ["body", "messages"], "msg": "Field required", "input": {}},
            {
                "type": "int_parsing",
                "loc": ["body", "n"],
                "msg": "Input should be a valid integer",
                "input": "x",
            },
        ]
    }
)
NAMED = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit", "code": "rate_limited"}})


@pytest.mark.parametrize(
    ("raw", "status", "message", "type_", "param", "code"),
    [
        (VLLM_SCHEMA, 400, None, "invalid_request_error", "temperature", "invalid_request_body"),
        (
            VLLM_MODEL,
            404,
            "The model `nope` does not exist.",
            "invalid_request_error",
            "model",
            "model_not_found",
        ),
        (VLLM_LENGTH, 400, None, "invalid_request_error", "input_tokens", "context_length_exceeded"),
        (VLLM_TOKENS, 400, None, "invalid_request_error", "input_tokens", "context_length_exceeded"),
        (VLLM_CHARS, 400, None, "invalid_request_error", "input_text", "context_length_exceeded"),
        (SGLANG_INPUT, 400, None, "invalid_request_error", None, "context_length_exceeded"),
        (SGLANG_TOTAL, 400, None, "invalid_request_error", None, "context_length_exceeded"),
        (SGLANG_FLAT, 400, "bad sampling params", "invalid_request_error", None, "bad_request"),
        (FASTAPI_404, 404, "Not Found", "invalid_request_error", None, "not_found"),
        (
            FASTAPI_422,
            422,
            "messages: Field required; n: Input should be a valid integer",
            "invalid_request_error",
            "messages",
            "validation_error",
        ),
        (LORA_INPUT, 400, None, "invalid_request_error", None, "invalid_user_input"),
        (
            b"upstream connect error or disconnect/reset before headers",
            503,
            None,
            "upstream_error",
            None,
            None,
        ),
        (b"<html><body>502 Bad Gateway</body></html>", 502, None, "upstream_error", None, None),
        (b"", 500, "upstream answered 500", "upstream_error", None, None),
        (NAMED, 429, "slow down", "rate_limit_error", None, "rate_limited"),
    ],
)
def test_engine_error_shapes(
    raw: bytes, status: int, message: str | None, type_: str, param: str | None, code: str | None
) -> None:
    err = orjson.loads(normalize_error_body(raw, status))["error"]
    assert list(err) == ["message", "type", "param", "code"]
    if message is None:  # the engine's own text, whole
        doc = orjson.loads(raw) if raw.startswith(b"{") else None
        expected = (doc.get("error") or doc)["message"] if doc else raw.decode()
        assert err["message"] == expected + (OPENAI_CONTEXT if raw in (VLLM_TOKENS, VLLM_CHARS) else "")
    else:
        assert err["message"] == message
    assert (err["type"], err["param"], err["code"]) == (type_, param, code)
