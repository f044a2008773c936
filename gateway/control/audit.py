"""The audit trail: who changed what on a running gateway (admin API, reloads), the latest first to go."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

AUDIT_SIZE = 200


class AuditTrail:
    def __init__(self, size: int = AUDIT_SIZE) -> None:
        self.changes: deque[dict[str, Any]] = deque(maxlen=size)

    def record(self, who: str, what: str) -> None:
        log.info("admin change by %s: %s", who, what)
        self.changes.append({"at": time.time(), "who": who, "what": what})
