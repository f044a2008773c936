"""Priority classes and prompt limits: which class a request runs in, how large its prompt may be.

The rules of `scheduler.classes`, `scheduler.max_prompt_tokens` and each tenant's caps, as
decisions only: the preparation step (gateway.path.prepare) applies them to the request, the
scheduler orders and admits by the class. Tenants above their class (`max_priority`) are lowered
to it, not rejected: the request is still legitimate, only not entitled to jump the queue.
Counted here for metrics: requests lowered, prompts trimmed, prompts refused as too large.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from gateway.admission.limits import ShedError
from gateway.config import SchedulerConfig, TenantConfig
from gateway.errors import GatewayError
from gateway.logs import clip


class PriorityClasses:
    def __init__(self, cfg: SchedulerConfig, tenants: Iterable[TenantConfig] = ()) -> None:
        self.cfg = cfg
        self.tenants = {t.name: t for t in tenants}
        self.levels = {c.name: c.level for c in cfg.classes}
        self.priority_lowered = 0
        self.prompts_trimmed = 0
        self.too_large: dict[str, int] = dict.fromkeys(self.levels, 0)  # per class

    def _tenant(self, name: str | None) -> TenantConfig | None:
        return self.tenants.get(name) if name else None

    def classify(self, name: str | None, tenant: str | None) -> tuple[str, int]:
        """The class (and its level) of a request that asked for class `name` (None: the default),
        lowered to the tenant's highest; 400 for a class that does not exist."""
        if name is None:
            name = self.cfg.default_class
        elif name not in self.levels:
            # A typo must not silently demote (or promote) a request: say which classes exist.
            raise GatewayError(
                400,
                f"unknown priority class {clip(name, 64)!r} in x-priority; "
                f"expected one of: {', '.join(self.levels)}",
                "invalid_request_error",
                "invalid_priority",
            )
        cap = self._tenant(tenant)
        if cap and cap.max_priority and self.levels[name] > self.levels[cap.max_priority]:
            name = cap.max_priority
            self.priority_lowered += 1
        return name, self.levels[name]

    def ceiling(self, tenant: str | None) -> int | None:
        """The highest level the tenant may run at, when it has a cap (`max_priority`)."""
        cap = self._tenant(tenant)
        return self.levels[cap.max_priority] if cap and cap.max_priority else None

    def prompt_limit(self, tenant: str | None) -> tuple[int | None, Literal["reject", "window"]]:
        """The prompt size limit in tokens (None: none) and what to do beyond it."""
        cap = self._tenant(tenant)
        if cap and cap.max_prompt_tokens:
            return cap.max_prompt_tokens, cap.prompt_overflow
        return self.cfg.max_prompt_tokens, self.cfg.prompt_overflow

    def prompt_too_large(self, cls: str, tokens: int, limit: int) -> ShedError:
        self.too_large[cls] += 1
        return ShedError(
            400,
            f"prompt is {tokens} tokens; the limit is {limit}",
            "prompt_too_large",
            type_="invalid_request_error",
        )
