#!/usr/bin/env bash
# The main job: install, then `edged rollout` — build base (Debian rootfs), workspace (a
# real project's sdist from PyPI) and toolkit (pytest + its test deps from PyPI) layers, start
# the daemon, run a batch of sandboxes in parallel that each run the project's tests, print a
# per-sandbox summary and totals, clean up.
#
#   bash scripts/main.sh [-n N] [--project NAME==VERSION] [--json]     # as root on Debian 12
#
# Environment: LAYERFS_STORE (default /var/lib/edged/layers), EDGED_TEST_CACHE (where the
# Debian rootfs tarball is cached, default /var/cache/edged-test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/rootfs.sh
exec .venv/bin/edged rollout "$@"
