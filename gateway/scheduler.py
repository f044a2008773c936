"""Admission in front of dispatch (placeholder: admits at once; the queue comes with issue 7)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import SchedulerConfig
from gateway.policy import RequestFeatures


class Ticket:
    __slots__ = ()

    def release(self) -> None:
        pass


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self._levels = {c.name: c.level for c in cfg.classes}

    def classify(
        self, features: RequestFeatures, headers: Mapping[str, str], body: Mapping[str, Any]
    ) -> None:
        name = headers.get("x-priority") or self.cfg.default_class
        features.priority_class = name if name in self._levels else self.cfg.default_class
        features.priority = self._levels[features.priority_class]

    async def admit(self, pool: object, features: RequestFeatures) -> Ticket:
        return Ticket()
