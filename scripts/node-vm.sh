#!/usr/bin/env bash
# A production-like node in a VM, and the test suite's node part run in it (issue 17):
# Debian 12 with systemd (cgroup v2 unified), Debian's 6.1 LTS cloud kernel with AppArmor
# enforcing, booted under QEMU (KVM when a bounded test boot finds it working, TCG
# otherwise); edged installed from a wheel of this checkout, edged.service enabled; the
# selection in tests/nodevm/driver.py run inside; results copied out; the guest shut down
# (always: no QEMU process or loop device is left). One command, idempotent: the base image
# is cached in /var/cache/edged-nodevm (made once, ~2 min) and rebuilt only when its inputs
# change. The last line is
#   node-vm: kernel K, cgroup v2, apparmor enforce, N passed, M failed, S skipped
# and the exit status is 0 only if nothing failed and nothing that should run there skipped.
#
#   bash scripts/node-vm.sh [--memory-mib 4096] [--vcpus 2] [--accel auto|kvm|tcg]
#                           [--timeout-min 70] [--out DIR] [--keep] [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${NODEVM_SKIP_INSTALL:-0}" != 1 ]; then
  bash scripts/install.sh
  bash scripts/rootfs.sh   # the Debian rootfs tarball the layer tests build from
fi
exec .venv/bin/python -m tests.nodevm.driver "$@"
