"""The tar source on a real Debian rootfs tarball (mmdebstrap minbase + python3).

Skips with a reason while the cached tarball is missing (see tests/layerfs/conftest.py
for how to build it)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from layerfs.mount import mounted_erofs
from layerfs.sources.tar import load_tar
from layerfs.tree import Tree
from layerfs.writer import write_image
from tests.layerfs.test_tar import read_data
from tests.layerfs.treecmp import assert_same, snapshot_dir, snapshot_tree

_TYPES = {tarfile.REGTYPE: stat.S_IFREG, tarfile.AREGTYPE: stat.S_IFREG,
          tarfile.DIRTYPE: stat.S_IFDIR, tarfile.SYMTYPE: stat.S_IFLNK,
          tarfile.CHRTYPE: stat.S_IFCHR, tarfile.BLKTYPE: stat.S_IFBLK,
          tarfile.FIFOTYPE: stat.S_IFIFO}


def _check_against_tarfile(tree: Tree, tar_path: Path) -> int:
    """Every member of the archive, as Python's tarfile lists it, is in ``tree`` with
    the same type, mode, owner, mtime, size, target, device and xattrs; hardlinks share
    an inode. Returns the number of members checked."""
    last: dict[str, tarfile.TarInfo] = {}
    with tarfile.open(tar_path) as tf:
        members = tf.getmembers()
        for m in members:
            last[os.path.normpath(m.name)] = m
        for m in members:
            if last[os.path.normpath(m.name)] is not m:
                continue  # a later member for the same path wins
            node = tree.get(m.name)
            assert node is not None, m.name
            if m.islnk():
                assert node is tree.get(m.linkname), m.name
                continue
            assert stat.S_IFMT(node.mode) == _TYPES[m.type], m.name
            assert node.mode & 0o7777 == m.mode, m.name
            assert (node.uid, node.gid) == (m.uid, m.gid), m.name
            assert node.mtime_ns // 10**9 == int(m.mtime), m.name
            if "mtime" in m.pax_headers:
                assert abs(node.mtime_ns / 1e9 - float(m.pax_headers["mtime"])) < 1e-6
            xattrs = {k[len("SCHILY.xattr."):].encode(): v.encode("utf-8", "surrogateescape")
                      for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
            assert node.xattrs == xattrs, m.name
            if m.isreg():
                assert node.size == m.size, m.name
                f = tf.extractfile(m)
                assert f is not None and read_data(node) == f.read(), m.name
            elif m.issym():
                assert node.target == m.linkname.encode("utf-8", "surrogateescape")
            elif m.ischr() or m.isblk():
                assert (node.rdev_major, node.rdev_minor) == (m.devmajor, m.devminor)
    return len(members)


def test_debian_tar_in_place_matches_tarfile(debian_tar: Path, tmp_path: Path) -> None:
    tree = load_tar(debian_tar, workdir=tmp_path)
    assert os.listdir(tmp_path) == []  # referenced in place, nothing spooled
    assert _check_against_tarfile(tree, debian_tar) > 5000
    assert tree.get("usr/bin/python3") is not None
    assert tree.get("dev/null") is not None


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd tool")
def test_debian_tar_zstd_spooled_equals_in_place(debian_tar: Path, tmp_path: Path) -> None:
    packed = tmp_path / "rootfs.tar.zst"
    subprocess.run(["zstd", "-q", "-1", "-T2", str(debian_tar), "-o", str(packed)],
                   check=True)
    work = tmp_path / "work"
    work.mkdir()
    spooled = load_tar(packed, workdir=work)
    assert len(os.listdir(work)) == 1
    assert_same(snapshot_tree(spooled), snapshot_tree(load_tar(debian_tar, workdir=work)))


@pytest.mark.mount
def test_debian_tar_image_mounts_as_listed(debian_tar: Path, scratch: Path) -> None:
    tree = load_tar(debian_tar, workdir=scratch)
    image = scratch / "rootfs.erofs"
    write_image(tree, image)
    with mounted_erofs(image) as mp:
        assert_same(snapshot_dir(mp), snapshot_tree(tree))
