"""Request validation as vLLM's OpenAI server does it, with its status codes, error types and texts.

vLLM validates a body in two places, and clients can tell them apart:
- FastAPI parses it into a pydantic request model. Its `mode="before"` model validators run first (the last
  defined first), then the field types. A failure is a 400 from the validation handler with type
  "Bad Request" and the message `N validation error(s):\\n  {error dict}` (one line per pydantic error, the
  location cleaned to `body.field`); `param` is the failing validator's parameter, else the location.
- The serving layer (model check, tool parser, chat template, context length, sampling parameters) answers
  with `create_error_response`: type "BadRequestError" (404 "NotFoundError" for an unknown model), `param`
  from the VLLMValidationError, whose text ends in ` (parameter=..., value=...)`.

The request models below declare the field types vLLM declares (vllm/entrypoints/openai/chat_completion/
protocol.py at 002032ee, completion/protocol.py at d5dba2d7, the pooling and tokenize protocols), so
pydantic gives exactly vLLM's coercions and messages for them, in a few microseconds per request. Chat
messages are checked by hand on the hot path; only an invalid message list builds the (slower) union
adapter that reproduces pydantic's per-member errors.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Annotated, Any, Literal, Required, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from gateway.sim.protocol import HTTPError

_INT64 = 2**63
BAD_REQUEST = "Bad Request"  # HTTPStatus.BAD_REQUEST.phrase: vLLM's validation handler's error type
_Model = TypeVar("_Model", bound=BaseModel)
_MAX_REPORTED = 10  # vLLM reports the first 10 pydantic errors and counts the rest
_INPUT_CHARS = 200
# Pydantic's internal location segments that vLLM's clean_loc_for_param drops (unbracketed ones).
_INTERNAL_LOC = frozenset(
    "function-wrap function-after function-before function-plain json-or-python lax-or-strict chain default "
    "nullable tagged-union union call arguments is-instance is-subclass callable str int float bool bytes "
    "bytearray list tuple dict set frozenset complex none nonetype".split()
)


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM allows (and logs) extra fields


class StreamOptions(Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(Lenient):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuralTagResponseFormat(Lenient):
    type: Literal["structural_tag"]
    format: Any


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    function: NamedFunction
    type: Literal["function"] = "function"


Stop = str | Annotated[list[str], Field(max_length=64)] | None
Seed = Annotated[int, Field(ge=-_INT64, le=_INT64 - 1)] | None


class _Sampling(Lenient):
    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = 1
    seed: Seed = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    prompt_logprobs: int | None = None
    priority: Annotated[int, Field(ge=-_INT64, le=_INT64 - 1)] = 0
    request_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Any]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | StructuralTagResponseFormat | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none"] | Literal["auto"] | Literal["required"] | NamedToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1  # not Optional here, as in vLLM
    suffix: str | None = None
    response_format: ResponseFormat | StructuralTagResponseFormat | None = None
    add_special_tokens: bool = True


class EmbeddingCompletionRequest(Lenient):
    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str] | None = None
    messages: list[Any] | None = None
    encoding_format: Literal["float", "base64", "bytes"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    normalize: bool | None = None
    priority: int = 0
    add_special_tokens: bool = True


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolParam] | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


class LoadLoRARequest(Lenient):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRARequest(Lenient):
    lora_name: str
    lora_int_id: int | None = None


# ---- errors in vLLM's shapes ---------------------------------------------------------------------------


class _CtxError:
    """Renders in an error dict as the exception object pydantic keeps in `ctx` would: `Cls('text')`."""

    __slots__ = ("text",)

    def __init__(self, cls: str, message: str) -> None:
        self.text = f"{cls}({message!r})"

    def __repr__(self) -> str:
        return self.text


def vllm_validation_text(message: str, parameter: str | None = None, value: Any = None) -> str:
    """str(VLLMValidationError): the message, then ` (parameter=..., value=...)` for what is set."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return f"{message} ({', '.join(extras)})" if extras else message


def _summarize(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= _INPUT_CHARS else value[:_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, (list, tuple, dict, set)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= _INPUT_CHARS else text[:_INPUT_CHARS] + "...[truncated]"


def clean_loc(loc: Iterable[Any]) -> str:
    """vLLM's clean_loc_for_param: drop pydantic's union-branch and wrapper markers from a location."""
    parts = [str(p) for p in loc]
    kept = [p for p in parts if not any(c in p for c in "[]{}()") and p.lower() not in _INTERNAL_LOC]
    return ".".join(kept or parts)


def schema_error(errors: list[Any], param: str | None = None) -> HTTPError:
    """A pydantic failure answered as vLLM's validation_exception_handler does. Each error's `loc`
    starts with "body" (FastAPI's body parameter)."""
    if param is None and errors and isinstance(errors[0], dict):
        param = clean_loc(errors[0]["loc"])
    lines = []
    for err in errors[:_MAX_REPORTED]:
        if not isinstance(err, dict):
            lines.append(f"  {err}\n")
            continue
        shown = {k: v for k, v in err.items() if k != "url"}
        shown["loc"] = clean_loc(err["loc"])
        if "input" in shown:
            shown["input"] = _summarize(shown["input"])
        lines.append(f"  {shown}\n")
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(lines)
    if count > _MAX_REPORTED:
        message += f"  ...and {count - _MAX_REPORTED} more {label}\n"
    return HTTPError(400, message.rstrip(), param, BAD_REQUEST)


def value_error(body: Any, message: str, parameter: str | None = None, value: Any = None) -> HTTPError:
    """A `mode="before"` model validator that raised: one value_error at `body`."""
    cls = "VLLMValidationError" if parameter is not None else "ValueError"
    text = vllm_validation_text(message, parameter, value) if parameter is not None else message
    err = {
        "type": "value_error",
        "loc": ("body",),
        "msg": f"Value error, {text}",
        "input": body,
        "ctx": {"error": _CtxError(cls, message)},
    }
    return schema_error([err], parameter)


def bad_request(message: str, parameter: str | None = None, value: Any = None) -> HTTPError:
    """The serving layer's create_error_response for a VLLMValidationError (or a plain ValueError)."""
    return HTTPError(400, vllm_validation_text(message, parameter, value), parameter, "BadRequestError")


def parse(model: type[_Model], body: dict[str, Any]) -> _Model:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise schema_error(errors) from None


# ---- model validators (mode="before"), in the order pydantic runs them --------------------------------


def _cache_salt(body: dict[str, Any]) -> None:
    salt = body.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise value_error(
            body, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > 128 or any(c in salt for c in "@/\\\x00"):
        raise value_error(
            body,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
            "or NUL.",
            "cache_salt",
        )


def _stream_options(body: dict[str, Any]) -> None:
    if body.get("stream_options") and not body.get("stream"):
        raise value_error(body, "Stream options can only be defined when `stream=True`.", "stream_options")


def _prompt_logprobs(body: dict[str, Any]) -> None:
    pl = body.get("prompt_logprobs")
    if not isinstance(pl, (int, float)):
        return  # None, or a wrong type left to the field's own error
    if body.get("stream") and (pl > 0 or pl == -1):
        raise value_error(body, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if pl < 0 and pl != -1:
        raise value_error(body, "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", pl)


def _chat_logprobs(body: dict[str, Any]) -> None:
    for name in ("prompt_logprobs", "top_logprobs"):
        v = body.get(name)
        if v is not None and not isinstance(v, (int, float)):
            raise value_error(body, f"`{name}` must be an integer.", name, v)
    _prompt_logprobs(body)
    tl = body.get("top_logprobs")
    if tl is not None:
        if tl < 0 and tl != -1:
            raise value_error(body, "`top_logprobs` must be a positive value or -1.", "top_logprobs", tl)
        if (tl == -1 or tl > 0) and not body.get("logprobs"):
            raise value_error(
                body, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )


_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _tool_usage(body: dict[str, Any]) -> None:
    if body.get("tools") == []:
        raise value_error(
            body,
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    # Without tool_choice, tools mean "auto" (vLLM writes that into the request; check_chat sets it after
    # parsing, so that the request log keeps the body as received).
    choice = body.get("tool_choice", "auto" if body.get("tools") else None)
    if choice is None or choice == "none":
        return
    if body.get("tools") is None:
        raise value_error(body, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise value_error(
            body,
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are '
            "supported.",
            "tool_choice",
        )
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            raise value_error(
                body,
                f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise value_error(
                body,
                f"Expected field `name` in `function` in `tool_choice`! {_USAGE}",
                "tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise value_error(
                body,
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}",
                "tool_choice.function.name",
            )
        tools = body["tools"] if isinstance(body["tools"], list) else []
        if not any(isinstance(t, dict) and (t.get("function") or {}).get("name") == name for t in tools):
            raise value_error(
                body,
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )


def _generation_prompt(body: dict[str, Any]) -> None:
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise value_error(
            body, "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )


def _response_format(body: dict[str, Any]) -> None:
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        raise value_error(
            body,
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            "response_format",
        )


def check_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    """ChatCompletionRequest: its before-validators (last defined first), then the field types, then
    the messages."""
    _generation_prompt(body)
    _tool_usage(body)
    _chat_logprobs(body)
    _stream_options(body)
    _response_format(body)
    _cache_salt(body)
    req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
    if "tool_choice" not in body and req.tools:
        req.tool_choice = "auto"
    check_messages(req.messages)
    return req


def check_completion(body: dict[str, Any]) -> CompletionRequest:
    _cache_salt(body)
    prompt = body.get("prompt")
    if (prompt is None or prompt == "") and not body.get("prompt_embeds"):
        raise value_error(body, "Either prompt or prompt_embeds must be provided and non-empty.")
    _stream_options(body)
    _prompt_logprobs(body)
    lp = body.get("logprobs")
    if isinstance(lp, (int, float)) and lp < 0:
        raise value_error(body, "`logprobs` must be a positive value.", "logprobs", lp)
    return parse(CompletionRequest, body)


# ---- chat messages ------------------------------------------------------------------------------------

_NULL_CONTENT_ROLES = ("assistant", "function")  # the OpenAI message types whose content may be null


def check_messages(messages: list[Any]) -> None:
    """vLLM's message union accepts any role (its custom message type has `role: str`) and a missing
    content, but not a null content outside assistant/function messages, nor a non-dict message."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            break
        if "content" in m:
            c = m["content"]
            if isinstance(c, list):
                if not all(isinstance(p, (dict, str)) for p in c):
                    break
            elif not isinstance(c, str) and not (c is None and m["role"] in _NULL_CONTENT_ROLES):
                break
    else:
        return
    try:
        _message_adapter().validate_python(messages)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", "messages", *e["loc"])} for e in exc.errors(include_url=False)]
        raise schema_error(errors) from None


class ChatCompletionDeveloperMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[dict[str, Any]]]
    role: Required[Literal["developer"]]
    name: str


class ChatCompletionSystemMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[dict[str, Any]]]
    role: Required[Literal["system"]]
    name: str


class ChatCompletionUserMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[dict[str, Any] | str]]
    role: Required[Literal["user"]]
    name: str


class ChatCompletionAssistantMessageParam(TypedDict, total=False):
    role: Required[Literal["assistant"]]
    content: str | Iterable[dict[str, Any]] | None
    name: str
    refusal: str | None
    tool_calls: Iterable[dict[str, Any]]


class ChatCompletionToolMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[dict[str, Any]]]
    role: Required[Literal["tool"]]
    tool_call_id: Required[str]


class ChatCompletionFunctionMessageParam(TypedDict, total=False):
    content: Required[str | None]
    name: Required[str]
    role: Required[Literal["function"]]


class CustomChatCompletionMessageParam(TypedDict, total=False):
    role: Required[str]
    content: str | list[dict[str, Any] | str]
    name: str
    tool_call_id: str | None
    tool_calls: Iterable[dict[str, Any]] | None
    reasoning: str | None


@lru_cache(maxsize=1)
def _message_adapter() -> TypeAdapter[Any]:
    """vLLM's ChatCompletionMessageParam union (OpenAI's six message types, then vLLM's custom one; the
    harmony Message member is left out), built only when a message list fails the quick check."""
    member = (
        ChatCompletionDeveloperMessageParam
        | ChatCompletionSystemMessageParam
        | ChatCompletionUserMessageParam
        | ChatCompletionAssistantMessageParam
        | ChatCompletionToolMessageParam
        | ChatCompletionFunctionMessageParam
        | CustomChatCompletionMessageParam
    )
    return TypeAdapter(list[member])
