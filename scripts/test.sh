#!/usr/bin/env bash
# Install (idempotent), then run the default test suite: lint, types, pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`, `bash scripts/test.sh -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/rootfs.sh   # the real Debian rootfs several tests build layers from
bash scripts/fncall-rootfs.sh   # the FnCall image (python3, gcc, g++) its tests build a layer from
.venv/bin/ruff check .
.venv/bin/mypy edged layerfs
# The default selection unless the arguments choose their own with -m (extra options such
# as --basetemp or -x alone no longer drop it and start the slow, bench and vm tests)
has_m=0
for a in "$@"; do
  case "$a" in -m|-m*) has_m=1 ;; esac
done
if [ "$has_m" -eq 0 ]; then
  set -- -m "not slow and not bench and not vm" "$@"
fi
exec .venv/bin/python -m pytest "$@"
