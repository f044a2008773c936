"""Reading a config: the YAML file, merged with overrides, validated, every failure one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import (
    SettingsError,
)

from gateway.config.base import ConfigError
from gateway.config.settings import Settings


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{key}: {first['msg']}{more}"


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
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}") from None
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
