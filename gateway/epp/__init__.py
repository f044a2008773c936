"""EPP mode: kvgate as the Endpoint Picker of an Envoy gateway (Gateway API Inference Extension).
Envoy carries the bytes; over ext_proc (gRPC) it asks, per request, which endpoint serves it.
`server` serves the ext_proc service and gRPC health, `processor` is one request's stream,
`protocol` the protocol's messages, and `picking` the decision and its accounting: the one module
here that uses the request path's preparation, admission and routing (docs/epp.md).

May import: path, admission, routing, fleet and the base modules (config, errors, logs). Needs the
`kvgate[epp]` extra (grpcio, grpcio-health-checking, protobuf). `ext_proc.proto` holds the part of
Envoy's ext_proc protocol it speaks, wire-compatible, in a package of its own (`ext_proc_pb2` is
generated from it).
"""
