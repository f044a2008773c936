"""`kvgate epp`: the Endpoint Picker an Envoy gateway asks which endpoint serves each request."""

from __future__ import annotations

from pydantic import Field

from gateway.config.base import Strict


class EppConfig(Strict):
    """`kvgate epp`: the Endpoint Picker an Envoy gateway asks over ext_proc (gRPC) which endpoint
    serves each request (docs/epp.md). The request limits are the data plane's (`server.*`)."""

    host: str = Field("127.0.0.1", description="The address the ext_proc server binds")
    port: int = Field(9002, ge=0, le=65535, description="The ext_proc and gRPC health port (GIE's default)")
    fallback_endpoints: int | None = Field(
        None,
        ge=1,
        description="Endpoints in x-gateway-destination-endpoint, best first, for the gateway's retries "
        "(unset: retry.max_attempts)",
    )
    objectives: dict[str, str] = Field(
        default_factory=dict,
        description="x-gateway-inference-objective name -> priority class; an objective naming a class "
        "needs no entry, an unknown one runs in the request's own class",
    )
    max_request_messages: int = Field(
        65_536, gt=0, description="ext_proc messages one request's headers and body may take"
    )
    max_response_buffer_bytes: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description="A JSON answer whose model name is rewritten is held whole up to this; past it, "
        "relayed as it is",
    )
    max_concurrent_streams: int = Field(10_000, gt=0, description="ext_proc streams served at once")
