"""What every settings model shares: unknown keys refused, and the one error a bad config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(Exception):
    """A config that cannot be served; the message is meant for one log line."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
