"""The single-instance backend: all state is this process's own, nothing is shared."""

from __future__ import annotations

from gateway.control.state.base import StateBackend


class MemoryState(StateBackend):
    name = "memory"
