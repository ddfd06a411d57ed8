#!/usr/bin/env bash
# The main job: install, then `edged rollout`, an RL rollout: layers for three real projects
# from PyPI (base: Debian rootfs; workspace: the project and its test deps; toolkit: pytest),
# a bug put in each and snapshotted into a task layer, episodes of three scripted agents
# (solver, lazy, cheater) through shell sessions, rewards from a trusted grader; prints the
# per-episode rewards, episodes/s, sandbox-seconds and the security events the cheater
# caused, cleans up. (`edged suite --project NAME==VERSION` runs one project's test suite.)
#
#   bash scripts/main.sh [--tasks a,b] [--episodes N] [--parallel N] [--json]   # as root
#
# Environment: LAYERFS_STORE (default /var/lib/edged/layers), EDGED_TEST_CACHE (where the
# Debian rootfs tarball is cached, default /var/cache/edged-test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/rootfs.sh
exec .venv/bin/edged rollout "$@"
