"""The checked-in protobuf code of the E2B listener is what scripts/gen-proto.sh makes from
the .proto files (with the pinned grpcio-tools), and the messages keep E2B's wire names."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTO = Path(__file__).resolve().parents[3] / "edged" / "compat" / "e2b" / "proto"


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    for f in PROTO.glob("*.proto"):
        shutil.copy(f, tmp_path)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--pyi_out=.", "process.proto", "filesystem.proto"], cwd=tmp_path,
                   check=True)
    for name in ("process_pb2.py", "process_pb2.pyi", "filesystem_pb2.py",
                 "filesystem_pb2.pyi"):
        assert (tmp_path / name).read_text() == (PROTO / name).read_text(), name


def test_wire_names() -> None:
    from google.protobuf import json_format

    from edged.compat.e2b.proto import filesystem_pb2, process_pb2

    assert process_pb2.DESCRIPTOR.services_by_name["Process"].full_name == "process.Process"
    assert (filesystem_pb2.DESCRIPTOR.services_by_name["Filesystem"].full_name
            == "filesystem.Filesystem")
    ev = process_pb2.StartResponse(event=process_pb2.ProcessEvent(
        end=process_pb2.ProcessEvent.EndEvent(exit_code=-1, exited=False, status="x")))
    assert json_format.MessageToDict(ev) == {
        "event": {"end": {"exitCode": -1, "status": "x"}}}
    assert process_pb2.StartRequest.FromString(
        process_pb2.StartRequest(tag="t").SerializeToString()).tag == "t"
