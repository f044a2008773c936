"""The Endpoint Picker protocol's messages (Gateway API Inference Extension, proposal 004) over
Envoy's ext_proc v3: what is read from Envoy's requests and how answers are built.

- The destination: `x-gateway-destination-endpoint` as a request header and, with the same value,
  in the `envoy.lb` dynamic metadata; an ordered `ip:port,ip:port` list the gateway walks on retry.
- The subset hint: `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the
  request's metadata context, the only endpoints allowed.
- The served endpoint: `envoy.lb` / `x-gateway-destination-endpoint-served` in the response's
  metadata context.
- Bodies go both ways in FULL_DUPLEX_STREAMED mode: each body answer is a `streamed_response`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from google.protobuf import struct_pb2

from gateway.epp import ext_proc_pb2 as ext_proc

LB = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
# Envoy's advice for a streamed body answer: chunks of at most 64 KiB.
CHUNK_BYTES = 62_000
MAX_SUBSET = 4096  # endpoints read from one subset hint

_OVERWRITE = ext_proc.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(msg: Any) -> dict[str, str]:
    """An HttpHeaders message's headers, names lower-cased (pseudo-headers such as `:path` kept);
    a repeated header's values joined by commas."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def _metadata_field(request: Any, namespace: str, key: str) -> Any:
    if not request.HasField("metadata_context"):
        return None
    space = request.metadata_context.filter_metadata.get(namespace)
    if space is None or key not in space.fields:
        return None
    return space.fields[key]


def subset_hint(request: Any) -> list[str] | None:
    """The endpoints the gateway allows for this request; None when it sent no hint (all are).
    A list of strings, or one comma-separated string, as gateways write it."""
    value = _metadata_field(request, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values[:MAX_SUBSET] if v.HasField("string_value")]
    else:
        items = value.string_value.split(",")[:MAX_SUBSET]
    return [e.strip() for e in items if e.strip()]


def served_endpoint(request: Any) -> str | None:
    """The endpoint the gateway reports the request went to, when it reports one."""
    value = _metadata_field(request, LB, SERVED)
    if value is None or not value.HasField("string_value"):
        return None
    return value.string_value.strip() or None


def _options(headers: Mapping[str, str]) -> list[Any]:
    return [
        ext_proc.HeaderValueOption(
            header=ext_proc.HeaderValue(key=k, raw_value=v.encode("latin-1")), append_action=_OVERWRITE
        )
        for k, v in headers.items()
    ]


def route(endpoints: list[str], set_headers: Mapping[str, str], remove: list[str]) -> Any:
    """The request headers' answer: the destination list in the header and in `envoy.lb`, the
    route recomputed on the new headers."""
    destination = ",".join(endpoints)
    mutation = ext_proc.HeaderMutation(
        set_headers=_options({DESTINATION: destination, **set_headers}), remove_headers=remove
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB: {DESTINATION: destination}})
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


def _streamed(data: bytes, end: bool) -> Any:
    return ext_proc.CommonResponse(
        body_mutation=ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(body=data, end_of_stream=end)
        )
    )


def body_chunks(data: bytes, end: bool, request: bool) -> Iterator[Any]:
    """A body's answers (the request's or the response's), in chunks Envoy takes; `end` marks the
    last. An empty non-final piece sends nothing."""
    if not data and not end:
        return
    for start in range(0, max(1, len(data)), CHUNK_BYTES):
        piece = data[start : start + CHUNK_BYTES]
        last = end and start + CHUNK_BYTES >= len(data)
        body = ext_proc.BodyResponse(response=_streamed(piece, last))
        yield (
            ext_proc.ProcessingResponse(request_body=body)
            if request
            else ext_proc.ProcessingResponse(response_body=body)
        )


def answer_headers(set_headers: Mapping[str, str]) -> Any:
    """The response headers' answer: `set_headers` added (the request id, the replica that served)."""
    mutation = ext_proc.HeaderMutation(set_headers=_options(set_headers))
    return ext_proc.ProcessingResponse(
        response_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(header_mutation=mutation))
    )


def trailers(request: bool) -> Any:
    """Trailers passed on unchanged."""
    if request:
        return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
    return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


def immediate(status: int, body: bytes, headers: Mapping[str, str]) -> Any:
    """An answer Envoy sends the client instead of forwarding the request: an OpenAI-style error."""
    mutation = ext_proc.HeaderMutation(set_headers=_options({"content-type": "application/json", **headers}))
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=ext_proc.HttpStatus(code=status), headers=mutation, body=body, details="kvgate_epp"
        )
    )
