#!/usr/bin/env bash
# Make the Debian rootfs tarball of the FnCall image that its tests and benchmark build a
# layer from, if it is not there yet: scripts/rootfs.sh with python3 (the warm Python
# runtime and the call server), gcc and g++ (the C and C++ languages of
# edged/backends/fncall/languages.py): ~50 s and ~80 MiB of packages once, needs the Debian
# mirror; idempotent and safe to run concurrently, as rootfs.sh is.
#
#   bash scripts/fncall-rootfs.sh [PATH]     # default $EDGED_TEST_CACHE/fncall-rootfs.tar
set -euo pipefail
cache=${EDGED_TEST_CACHE:-/var/cache/edged-test}
ROOTFS_INCLUDE=python3,gcc,g++ exec bash "$(dirname "$0")/rootfs.sh" "${1:-$cache/fncall-rootfs.tar}"
