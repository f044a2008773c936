"""The ext_proc messages kvgate speaks: generated from gateway/epp/ext_proc.proto, and beside
OpenTelemetry's protos in one process (Envoy's own generated protos, xds-protos, replace those on
install and break the OTLP exporter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

EPP = REPO / "gateway" / "epp"


def test_the_committed_messages_are_generated_from_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the messages")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{EPP}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
    ]
    subprocess.run([*cmd, str(EPP / "ext_proc.proto")], check=True)
    for name in ("ext_proc_pb2.py", "ext_proc_pb2.pyi"):
        assert (tmp_path / name).read_text() == (EPP / name).read_text(), (
            f"gateway/epp/{name} is stale: regenerate it with the command in gateway/epp/ext_proc.proto"
        )


def test_the_epp_messages_and_the_otlp_exporter_load_together() -> None:
    code = (
        "import gateway.epp.protocol\n"
        "from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_a_request_headers_answer_is_envoys_on_the_wire() -> None:
    """Field numbers are Envoy's: the destination in the header mutation and `envoy.lb` metadata."""
    from gateway.epp import protocol

    raw = protocol.route(
        ["10.0.0.1:8000", "10.0.0.2:8000"], {"x-request-id": "r"}, ["x-sim-fault"]
    ).SerializeToString()
    # ProcessingResponse.request_headers (field 1, a message) first
    assert raw[0] == (1 << 3 | 2)
    assert b"x-gateway-destination-endpoint" in raw and b"10.0.0.1:8000,10.0.0.2:8000" in raw
    # ProcessingResponse.dynamic_metadata (8), a Struct holding envoy.lb
    assert bytes([8 << 3 | 2]) in raw and b"envoy.lb" in raw
