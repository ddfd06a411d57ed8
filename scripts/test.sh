#!/usr/bin/env bash
# Install (idempotent), then run the default test suite: lint, types, pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/rootfs.sh   # the real Debian rootfs several tests build layers from
bash scripts/fncall-rootfs.sh   # the FnCall image (python3, gcc, g++) its tests build a layer from
.venv/bin/ruff check .
.venv/bin/mypy edged layerfs
if [ "$#" -eq 0 ]; then
  set -- -m "not slow and not bench and not vm"
fi
exec .venv/bin/python -m pytest "$@"
