#!/usr/bin/env bash
# Install everything the project needs on a fresh Debian 12 machine, idempotently:
# the system packages (apt), a virtualenv at .venv with the project and its test tools,
# and the compiled C core. Safe to run again; does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential pkg-config clang            # C core, BPF programs
  libzstd-dev libxxhash-dev libssl-dev        # chunk compression, hashing
  libfuse3-dev fuse3                          # lazy layer file server
  libseccomp-dev libcap-dev libbpf-dev        # confinement; libbpf: loads the egress programs (edged/net)
  nftables                                    # NAT of networked sandboxes to the uplink (edged/net)
  bpftool                                     # inspecting the attached egress programs and maps by hand
  apparmor xfslibs-dev                        # apparmor_parser compile checks; XFS ioctl headers for tests
  erofs-utils                                 # fsck.erofs / mkfs.erofs: cross-checks, benchmark baseline
  mmdebstrap                                  # real Debian rootfs for tests and the main job
  xfsprogs attr zstd busybox-static bubblewrap util-linux
  musl-tools                                  # static sbx-init (~100 KiB); glibc -static otherwise
  qemu-system-x86 qemu-utils                  # microVM backend: the VMM (microvm machine, TCG/KVM)
  kmod                                        # modinfo: the guest kernel modules' dependencies
  e2fsprogs                                   # mkfs.ext4: a microVM's upper disk
  strace                                      # tests: which syscalls the EROFS writer makes
  python3-venv
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "install.sh: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel cffi >/dev/null
# Editable install: builds layerfs._native and edged._native (the C core) in place through cffi.
# "compat" mode puts the checkout on sys.path with a plain .pth line; the default (an import
# hook, setuptools' editable finder) costs ~12 ms at every Python start here (22.5 against
# 10.2 ms for `python -c pass`, 2026-12-01), which every CLI call, bench child and daemon paid.
# setuptools calls compat mode transitional: where a future setuptools refuses it, the default
# editable install is made instead (the same code, ~12 ms slower to start).
.venv/bin/python -m pip install -q -e '.[test]' --config-settings editable_mode=compat \
  || .venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c 'import layerfs.native, edged.native' # fails loudly if the C core did not build
# The microVM guest's kernel (Debian's cloud kernel, fetched and unpacked, not installed on
# the host) and its module lists, in /var/cache/edged-guest (or $EDGED_GUEST_DIR).
.venv/bin/python -m edged.backends.microvm.guestkit install >/dev/null
