"""Reading a config: the YAML file, merged with overrides, validated, every failure one line that
names the key and says what is wrong with it (a YAML error: the parser's reason and where)."""

from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import SettingsError

from gateway.config.base import ConfigError, Strict
from gateway.config.settings import Settings, _model_in

# Pydantic puts a union member's name into an error's location (`server.ready.literal['any','all']`,
# `port.int`, a model's class name); such a segment is no key of the file.
_UNION_TAGS = frozenset({"int", "float", "str", "bool", "none", "list", "dict"})


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Read, merge and validate; every failure becomes a one-line ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            raw = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML{_yaml_problem(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded or {}
    data.update(overrides or {})
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
    except SettingsError as exc:  # an environment value that cannot be read at all
        message = str(exc).splitlines()[0].replace('source "_EnvSource"', "the KVGATE_* environment")
        raise ConfigError(message) from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """` at line L, column C: the parser's reason (while parsing X at line L, column C)`."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return f": {exc}"
    out = f" at {_mark(exc.problem_mark)}" if exc.problem_mark else ""
    out += f": {exc.problem}" if exc.problem else ""
    if exc.context:
        where = f" at {_mark(exc.context_mark)}" if exc.context_mark else ""
        out += f" ({exc.context}{where})"
    return out


def _mark(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _format_error(err: ValidationError) -> str:
    """`key: reason`, for the first key in error (the reasons of every union member it failed),
    and how many more keys are wrong. A check across keys has no location: its reason names them."""
    errors = err.errors()
    keys = [_key(e) for e in errors]
    first = keys[0]
    reasons = list(dict.fromkeys(_reason(e) for e, key in zip(errors, keys, strict=True) if key == first))
    others = len(set(keys) - {first})
    more = f" (and {others} more)" if others else ""
    text = "; or ".join(reasons)
    return f"{'.'.join(first)}: {text}{more}" if first else f"{text}{more}"


def _key(error: ErrorDetails) -> tuple[str, ...]:
    return tuple(
        str(part)
        for part in error["loc"]
        if isinstance(part, int) or not ("[" in part or part in _UNION_TAGS or part in _model_names())
    )


@functools.cache
def _model_names() -> frozenset[str]:
    return frozenset(model.__name__ for model in Strict.__subclasses__())


def _reason(error: ErrorDetails) -> str:
    if error["type"] == "extra_forbidden":
        return "not a setting" + _did_you_mean(error)
    message = error["msg"]
    # A validator's ValueError, which pydantic prefixes: the text after it is the reason.
    return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _did_you_mean(error: ErrorDetails) -> str:
    """The closest setting's name where the unknown key looks like a misspelling of one."""
    model: type[BaseModel] | None = Settings
    *parents, unknown = _key(error)
    for part in parents:
        if model is None:
            return ""
        if part.isdigit():
            continue
        info = model.model_fields.get(part)
        model = None if info is None else _model_in(info.annotation)
    if model is None:
        return ""
    close = difflib.get_close_matches(unknown, list(model.model_fields), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
