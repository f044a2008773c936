"""The endpoints served for inference, in one table: which URL paths serve each, which pool tasks can
answer it, and where its request carries what the gateway measures and bounds.

Every other part reads this table: the data plane's routes, the model catalog (task matching),
prefix hashing (where the prompt is), the work bounds (prompts and inputs per request), the prompt
window (the conversation it trims) and failover (what can be continued).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.config import Task

Endpoint = Literal["chat", "completions", "responses", "embeddings", "pooling", "classify", "score", "rerank"]


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    name: Endpoint
    paths: tuple[str, ...]
    # Pool tasks that can answer it (vLLM registers its routes the same way: embeddings for `embed`,
    # classify for `classify`, score and rerank for `score` or `embed`, pooling for any of them).
    tasks: frozenset[Task]
    # Where a non-conversation request carries its prompt(s), in order of preference: a string, a
    # list of strings, token ids, or a list of token-id lists. Empty: the prompt is a conversation.
    prompt_fields: tuple[str, ...] = ()
    conversation: str | None = None  # the field holding its turns (the prompt window trims it)
    prompts: tuple[str, ...] = ()  # fields counted against `server.max_prompts` (a batch)
    inputs: tuple[str, ...] = ()  # fields counted against `server.max_inputs`


_GENERATE: frozenset[Task] = frozenset({"generate"})
_SCORE: frozenset[Task] = frozenset({"score", "embed"})

TABLE: tuple[EndpointSpec, ...] = (
    EndpointSpec("chat", ("/v1/chat/completions",), _GENERATE, conversation="messages"),
    EndpointSpec("completions", ("/v1/completions",), _GENERATE, ("prompt",), prompts=("prompt",)),
    EndpointSpec("responses", ("/v1/responses",), _GENERATE, conversation="input"),
    EndpointSpec("embeddings", ("/v1/embeddings",), frozenset({"embed"}), ("input",), inputs=("input",)),
    EndpointSpec(
        "pooling", ("/pooling",), frozenset({"embed", "classify", "score"}), ("input",), inputs=("input",)
    ),
    EndpointSpec("classify", ("/classify",), frozenset({"classify"}), ("input",), inputs=("input",)),
    EndpointSpec(
        "score",
        ("/score", "/v1/score"),
        _SCORE,
        ("queries", "data_1", "text_1"),
        inputs=("text_1", "text_2", "queries", "documents", "items"),
    ),
    EndpointSpec(
        "rerank", ("/rerank", "/v1/rerank", "/v2/rerank"), _SCORE, ("query",), inputs=("documents",)
    ),
)

BY_NAME: dict[str, EndpointSpec] = {spec.name: spec for spec in TABLE}
# The URL paths served for inference, and the endpoint each is.
PATHS: dict[str, Endpoint] = {path: spec.name for spec in TABLE for path in spec.paths}
