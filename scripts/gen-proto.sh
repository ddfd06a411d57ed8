#!/usr/bin/env bash
# Regenerate the protobuf code of the E2B-compatible listener from its .proto files
# (edged/compat/e2b/proto/*.proto), with the pinned grpcio-tools of the test extra
# (pyproject.toml). tests/edged/compat/test_proto.py checks that the checked-in code is what
# this makes.
set -euo pipefail
cd "$(dirname "$0")/../edged/compat/e2b/proto"
exec ../../../../.venv/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \
    process.proto filesystem.proto
