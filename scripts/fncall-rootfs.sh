#!/usr/bin/env bash
# Make the Debian rootfs tarball of the FnCall image that tests and benchmarks build their
# layer from, if it is not there yet: `mmdebstrap --variant=minbase
# --include=python3,gcc,g++ bookworm` (~50 s and ~80 MiB of packages once, needs the Debian
# mirror): python3 for the warm Python runtime, gcc and g++ for the C and C++ languages
# (edged/backends/fncall/languages.py). Idempotent; safe to run concurrently (builds under a
# private name, then renames), like scripts/rootfs.sh.
#
#   bash scripts/fncall-rootfs.sh [PATH]     # default $EDGED_TEST_CACHE/fncall-rootfs.tar
set -euo pipefail
cache=${EDGED_TEST_CACHE:-/var/cache/edged-test}
dest=${1:-$cache/fncall-rootfs.tar}
[ -s "$dest" ] && exit 0
mkdir -p "$(dirname "$dest")"
# mmdebstrap picks the output format from the file name: the temporary name must end in .tar.
part="$(dirname "$dest")/.fncall-rootfs.$$.tar"
trap 'rm -f "$part"' EXIT
echo "fncall-rootfs.sh: making $dest with mmdebstrap (minbase + python3, gcc, g++)" >&2
mmdebstrap --quiet --variant=minbase --include=python3,gcc,g++ bookworm "$part"
mv -f "$part" "$dest"
trap - EXIT
