"""The Endpoint Picker's gRPC server: the ext_proc service and gRPC health checking, on one port.

Health (the protocol's three services): `liveness` is SERVING while the process serves gRPC;
`readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` are SERVING while the picker can
route (by `server.ready`, as the proxy's /ready) and NOT_SERVING otherwise and from the start of
a shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.config import EppConfig
from gateway.epp.ext_proc_pb2 import ProcessingRequest, ProcessingResponse
from gateway.epp.processor import Processor

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_POLL_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EppListenError(OSError):
    """The EPP's address cannot be bound."""


class EppServer:
    """The ext_proc servicer (`processor`) and health, served on `epp.host:epp.port`."""

    def __init__(
        self,
        cfg: EppConfig,
        processor: Processor,
        ready: Callable[[], bool],
    ) -> None:
        self.cfg = cfg
        self.ready = ready
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            options=[
                # Envoy sends body chunks of its buffer's size; nothing near this.
                ("grpc.max_receive_message_length", 4 * 1024 * 1024),
                ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
            ],
            maximum_concurrent_rpcs=cfg.max_concurrent_streams,
        )
        # Envoy's method: /envoy.service.ext_proc.v3.ExternalProcessor/Process, one stream a request.
        process = grpc.stream_stream_rpc_method_handler(
            processor.Process,
            request_deserializer=ProcessingRequest.FromString,
            response_serializer=ProcessingResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": process}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self._watch: asyncio.Task[None] | None = None
        self._serving: bool | None = None

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        try:
            self.port = self.server.add_insecure_port(f"{host}:{self.cfg.port}")
        except RuntimeError as exc:
            raise EppListenError(f"cannot listen on epp.host:epp.port {self.address}: {exc}") from None
        await self.health.set("liveness", _SERVING)
        await self._set_ready(self.ready())
        await self.server.start()
        self._watch = asyncio.create_task(self._follow_readiness(), name="epp readiness")
        log.info("kvgate endpoint picker (ext_proc, gRPC health) on %s", self.address)

    async def _set_ready(self, ready: bool) -> None:
        if ready == self._serving:
            return
        self._serving = ready
        status = _SERVING if ready else _NOT_SERVING
        for service in ("readiness", EXT_PROC_SERVICE):
            await self.health.set(service, status)

    async def _follow_readiness(self) -> None:
        """Readiness follows the pools' health, which checks and the launcher change as flags."""
        while True:
            await self._set_ready(self.ready())
            await asyncio.sleep(READY_POLL_S)

    async def stop(self, grace_s: float) -> None:
        """Not ready at once; streams in flight get `grace_s` to finish, then are cancelled (and
        their requests settled)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self._set_ready(False)
        await self.server.stop(grace_s)
