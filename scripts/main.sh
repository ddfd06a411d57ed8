#!/usr/bin/env bash
# The main job (until the daemon exists): build a real base layer from a Debian rootfs,
# keep it in the chunk store, mount it file-backed and check it, print a summary.
#
#   bash scripts/main.sh            # as root on Debian 12
#
# Environment: LAYERFS_STORE (default /var/lib/edged/layers), ROOTFS_TAR (default
# /var/cache/edged-test/debian-rootfs.tar, made with mmdebstrap if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh

ROOTFS_TAR=${ROOTFS_TAR:-/var/cache/edged-test/debian-rootfs.tar}
export LAYERFS_STORE=${LAYERFS_STORE:-/var/lib/edged/layers}

if [ ! -s "$ROOTFS_TAR" ]; then
  echo "main.sh: making $ROOTFS_TAR with mmdebstrap (minbase + python3, bookworm)"
  mkdir -p "$(dirname "$ROOTFS_TAR")"
  # Others may make the same tarball at the same time: build under a private name, rename.
  part="$ROOTFS_TAR.$$.part"
  trap 'rm -f "$part"' EXIT
  mmdebstrap --quiet --variant=minbase --include=python3 bookworm "$part"
  mv -f "$part" "$ROOTFS_TAR"
  trap - EXIT
fi

exec .venv/bin/python - "$ROOTFS_TAR" <<'PY'
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

from layerfs.mount import mounted_erofs
from layerfs.progress import human_bytes
from layerfs.store import Store

tar_path = sys.argv[1]
layerfs = [os.path.join(sys.prefix, "bin", "layerfs")]


def run(*args: str) -> dict:
    out = subprocess.run([*layerfs, "--json", *args], check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    return json.loads(out)


t0 = time.monotonic()
built = run("build", tar_path, "--kind", "base")
build_s = time.monotonic() - t0
digest, size = built["digest"], built["size"]
store = Store(os.environ["LAYERFS_STORE"], create=False)
manifest = store.manifest(digest)
verified = run("verify", digest)
assert verified["ok"], verified

# The file to compare: python3's real binary, read from the source tarball.
with tarfile.open(tar_path) as tf:
    member = tf.getmember("./usr/bin/python3")
    target = os.path.normpath(os.path.join("/usr/bin", member.linkname))
    fobj = tf.extractfile("." + target)
    assert fobj is not None
    want = hashlib.sha256(fobj.read()).hexdigest()

with tempfile.TemporaryDirectory(prefix="main-job.") as tmp:
    image = os.path.join(tmp, "base.erofs")
    exported = run("export", digest, "-o", image)  # reassembled from chunks, verified
    with mounted_erofs(image) as mnt:
        py = os.path.join(mnt, "usr/bin/python3")
        assert os.path.islink(py), "usr/bin/python3 missing in the mounted layer"
        with open(os.path.join(mnt, target.lstrip("/")), "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
        listing = subprocess.run(["ls", "-l", py], check=True, stdout=subprocess.PIPE,
                                 text=True).stdout.strip()
        count = sum(len(files) + len(dirs) for _r, dirs, files in os.walk(mnt))
assert got == want, f"{target}: digest in the layer {got} != in the tarball {want}"

img = built.get("image", {})
ws = built["write_seconds"] or 1e-9
print("main job: base layer built, stored, mounted and checked")
print(f"  source       {tar_path} ({human_bytes(os.path.getsize(tar_path))})")
print(f"  digest       {digest}")
print(f"  image size   {size} bytes ({human_bytes(size)}), {img.get('inodes', '?')} inodes, "
      f"{count} names seen mounted")
print(f"  chunks       {len(manifest.chunks)} x {human_bytes(manifest.chunk_size)}, "
      f"{len({c.digest for c in manifest.chunks})} distinct, "
      f"{human_bytes(manifest.stored_size)} stored zstd "
      f"({built['new_chunks']} new, {built['reused_chunks']} already in the store)")
print(f"  write        {built['write_seconds']:.2f} s "
      f"({human_bytes(size / ws)}/s, {img.get('files', 0) / ws:.0f} files/s)")
print(f"  store        {built['store_seconds']:.2f} s; whole build command {build_s:.2f} s")
print(f"  check        {listing}")
print(f"  check        sha256 of {target} in the layer == in the tarball ({want[:16]}...)")
print(f"  store root   {store.root}")
PY
