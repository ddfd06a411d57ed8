#!/usr/bin/env bash
# Make the real Debian rootfs tarball that tests, benchmarks and the main job build layers
# from, if it is not there yet: `mmdebstrap --variant=minbase --include=python3 bookworm`
# (~20 s, needs the Debian mirror). Idempotent; safe to run concurrently (builds under a
# private name, then renames).
#
#   bash scripts/rootfs.sh [PATH]     # default $EDGED_TEST_CACHE/debian-rootfs.tar
# ROOTFS_INCLUDE: the packages beyond minbase (default python3; scripts/fncall-rootfs.sh adds
# the compilers).
set -euo pipefail
include=${ROOTFS_INCLUDE:-python3}
cache=${EDGED_TEST_CACHE:-/var/cache/edged-test}
dest=${1:-$cache/debian-rootfs.tar}
[ -s "$dest" ] && exit 0
mkdir -p "$(dirname "$dest")"
# mmdebstrap picks the output format from the file name: the temporary name must end in .tar.
part="$(dirname "$dest")/.$(basename "$dest" .tar).$$.tar"
trap 'rm -f "$part"' EXIT
echo "rootfs.sh: making $dest with mmdebstrap (minbase + $include, bookworm)" >&2
mmdebstrap --quiet --variant=minbase --include="$include" bookworm "$part"
mv -f "$part" "$dest"
trap - EXIT
