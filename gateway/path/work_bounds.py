"""How much work one request may ask of engines, checked before the gateway measures its prompt.

A body well under `server.max_body_bytes` can still ask for 100,000 completions (`n`), a batch of
500,000 prompts, or 100,000 embedding inputs: each is forwarded as one request that pins a
replica for minutes (and, abandoned, keeps it busy or gets it ejected). The caps are
`server.max_n` (`n`, and `best_of`), `server.max_prompts` (a completions batch),
`server.max_sequences` (prompts times choices) and `server.max_inputs` (the inputs of an
embeddings, pooling or classify request, the documents of a rerank, the texts of a score); past
one the request is a 400 naming the field. What passes is counted: `sequences` (prompts x choices)
is what admission and shortest-job-first charge the expected output for.

A capped count must be an integer: engines read `"1000"`, `" 1000"`, `1000.0` and `1e3` as 1,000
(pydantic's lax mode), so a cap that only looked at integers was bypassed by them. Other fields of
the wrong type are left to the engine, which says what it expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import ServerConfig
from gateway.errors import client_error
from gateway.prompt.endpoints import BY_NAME


def _count(value: Any) -> int:
    """Prompts in a prompt field: a string or a list of token ids is one; a list of them, each."""
    if not isinstance(value, list) or not value or isinstance(value[0], int):
        return 1
    return len(value)


def _choices(body: Mapping[str, Any], name: str, cap: int) -> int:
    """A count of choices (`n`, `best_of`): 1 when absent; 400 when it is no integer or past `cap`."""
    value = body.get(name)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise client_error(f"`{name}` must be an integer, not {type(value).__name__}", "invalid_type", name)
    if value > cap:
        raise client_error(f"`{name}` is {value}; at most {cap} (server.max_n)", "too_many_choices", name)
    return max(1, value)


def sequences(body: Mapping[str, Any], endpoint: str, cfg: ServerConfig) -> int:
    """The answers the request asks engines for (prompts x choices); 400 past `cfg`'s caps."""
    choices = max(_choices(body, "n", cfg.max_n), _choices(body, "best_of", cfg.max_n))
    prompts = 1
    spec = BY_NAME[endpoint]
    for name in spec.prompts:
        prompts = _count(body.get(name))
        if prompts > cfg.max_prompts:
            raise client_error(
                f"`{name}` holds {prompts} prompts; at most {cfg.max_prompts} (server.max_prompts)",
                "too_many_prompts",
                name,
            )
    for name in spec.inputs:
        inputs = _count(body.get(name))
        if inputs > cfg.max_inputs:
            raise client_error(
                f"`{name}` holds {inputs} inputs; at most {cfg.max_inputs} (server.max_inputs)",
                "too_many_inputs",
                name,
            )
    if prompts * choices > cfg.max_sequences:
        raise client_error(
            f"{prompts} prompts x {choices} choices is {prompts * choices} sequences; at most"
            f" {cfg.max_sequences} (server.max_sequences)",
            "too_many_sequences",
            "n",
        )
    return prompts * choices
