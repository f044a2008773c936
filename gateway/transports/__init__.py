"""Transports to engines behind one seam (see `base`); `upstream.transport` picks one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.transports.base import Transport

if TYPE_CHECKING:
    from gateway.config import UpstreamConfig


def make_transport(cfg: UpstreamConfig) -> Transport:
    if cfg.transport == "aiohttp":
        from gateway.transports.aiohttp_client import AiohttpTransport

        return AiohttpTransport(cfg)
    from gateway.transports.http1 import Http1Transport

    return Http1Transport(cfg)
