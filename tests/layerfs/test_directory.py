"""The directory source: a host tree → Tree → image → mount equals the host tree."""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import socket
import stat

import pytest

from layerfs.errors import InvalidSourceError
from layerfs.mount import mounted_erofs
from layerfs.sources.directory import load_directory, scan_directory
from layerfs.writer import WriterOptions, write_image
from tests.layerfs.conftest import DEBIAN_TAR, build_debian_tar, fsck_erofs
from tests.layerfs.treecmp import assert_same, snapshot_dir, snapshot_tree

S = 1_000_000_000
CAP = bytes.fromhex("01000002" "00200000" "00000000" "00000000" "00000000")


def _make(root: pathlib.Path, reverse: bool) -> None:
    """Create the same content in either order (names, xattrs, hardlink first/second)."""
    root.mkdir()
    steps = []
    steps.append(lambda: (root / "a.txt").write_bytes(b"a" * 5000))
    steps.append(lambda: (root / "!first").write_bytes(b""))
    steps.append(lambda: (root / "sub").mkdir())
    steps.append(lambda: (root / "sub" / "deep").mkdir())
    steps.append(lambda: (root / "sub" / "deep" / "x").write_bytes(b"x" * 70000))
    steps.append(lambda: os.symlink("../a.txt", root / "sub" / "rel"))
    for order in (steps if not reverse else list(reversed(steps[:2])) + steps[2:]):
        order()
    first, second = ("h1", "h2") if not reverse else ("h2", "h1")
    (root / first).write_bytes(b"hard")
    os.link(root / first, root / second)
    names = [b"user.b", b"user.a", b"trusted.z"]
    for n in (names if not reverse else names[::-1]):
        os.setxattr(root / "a.txt", n, n * 2)
    for p in [*sorted(root.rglob("*"), reverse=True), root]:
        os.utime(p, ns=(7 * S, 1_650_000_000 * S + 42), follow_symlinks=False)


@pytest.mark.root
def test_same_content_any_order_same_digest(scratch: pathlib.Path) -> None:
    digests = set()
    for i, rev in enumerate((False, True)):
        _make(scratch / f"src{i}", rev)
        write_image(load_directory(scratch / f"src{i}"), scratch / f"{i}.erofs")
        digests.add(hashlib.sha256((scratch / f"{i}.erofs").read_bytes()).hexdigest())
    assert len(digests) == 1


@pytest.mark.root
@pytest.mark.mount
def test_every_kind_of_entry(scratch: pathlib.Path) -> None:
    src = scratch / "src"
    src.mkdir()
    (src / "plain").write_bytes(os.urandom(12345))
    (src / "suid").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "suid", 0o4755)
    os.mkdir(src / "sticky", 0o755)
    os.chmod(src / "sticky", 0o3777)
    os.chown(src / "plain", 100000, 100001)
    os.setxattr(src / "suid", "security.capability", CAP)
    os.setxattr(src / "suid", "trusted.overlay.opaque", b"y")
    os.setxattr(src / "plain", "user.mime", b"text/plain")
    os.link(src / "plain", src / "sticky" / "plain-link")
    os.symlink("/does/not/exist", src / "dangling")
    os.setxattr(src / "dangling", "trusted.sym", b"1", follow_symlinks=False)
    os.mknod(src / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(src / "disk", stat.S_IFBLK | 0o660, os.makedev(259, 1048575))
    os.mknod(src / "whiteout", stat.S_IFCHR, 0)
    os.mkfifo(src / "fifo", 0o640)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(src / "sock"))
    finally:
        s.close()
    with open(src / "sparse", "wb") as f:
        f.truncate((64 << 20) + 5)
        f.seek(40 << 20)
        f.write(b"middle")
    os.utime(src / "plain", ns=(1, -5 * S + 3))
    os.utime(src / "fifo", ns=(1, 1_700_000_000 * S + 999_999_999))

    tree = load_directory(src)
    sparse = tree.get("sparse")
    assert sparse is not None and sparse.data is not None
    assert sparse.data.extents is not None and len(sparse.data.extents) == 1
    expected = snapshot_dir(src)
    assert_same(snapshot_tree(tree), expected)
    img = scratch / "img.erofs"
    st = write_image(tree, img)
    assert st.size < 2 << 20
    fsck_erofs(img)
    with mounted_erofs(img) as mp:
        assert_same(snapshot_dir(mp), expected)


def test_not_a_directory(scratch: pathlib.Path) -> None:
    (scratch / "f").write_bytes(b"")
    (scratch / "d").mkdir()
    os.symlink("d", scratch / "link")
    for path in (scratch / "f", scratch / "link"):  # a symlink to a directory is not one
        with pytest.raises(InvalidSourceError, match="not a directory"):
            load_directory(path)
        with pytest.raises(InvalidSourceError, match="not a directory"):
            scan_directory(path)
    with pytest.raises(OSError, match="missing") as ei:
        scan_directory(scratch / "missing")
    assert ei.value.errno == errno.ENOENT


@pytest.mark.root
def test_scan_writes_what_its_tree_writes(scratch: pathlib.Path) -> None:
    # `layerfs build DIR` writes the scan as is; load_directory() gives it as a Tree,
    # which the writer flattens again: both must be the same image.
    _make(scratch / "src", False)
    os.mknod(scratch / "src" / "wh", stat.S_IFCHR, os.makedev(0, 0))
    with open(scratch / "src" / "sparse", "wb") as f:
        f.seek(1 << 20)
        f.write(b"end")
    with open(scratch / "src" / "hole", "wb") as f:
        f.truncate(3 << 20)
    with open(os.path.join(os.fsencode(scratch / "src"), b"not-utf8-\xff\xfe"), "wb") as f:
        f.write(b"raw name")
    scan = scan_directory(scratch / "src")
    tree = scan.tree()
    sparse = tree.get("sparse")
    assert sparse is not None and sparse.data is not None and sparse.data.extents
    hole = tree.get("hole")
    assert hole is not None and hole.data is not None and hole.data.extents == ()
    assert tree.get("h1") is tree.get("h2")
    raw = tree.get(b"not-utf8-\xff\xfe")
    assert raw is not None and raw.data is not None
    with open(raw.data.path, "rb") as f:
        assert f.read() == b"raw name"
    again = scan_directory(f"{scratch}/src//").tree()  # trailing slashes: the same paths
    for node in (again.get("a.txt"), again.get("sub/deep/x")):
        assert node is not None and node.data is not None
        assert "//" not in node.data.path and os.path.isfile(node.data.path)
    write_image(scan, scratch / "scan.erofs")
    write_image(tree, scratch / "tree.erofs")
    assert (scratch / "scan.erofs").read_bytes() == (scratch / "tree.erofs").read_bytes()
    fsck_erofs(scratch / "scan.erofs")


@pytest.mark.root
@pytest.mark.mount
def test_debian_rootfs_roundtrip(debian_rootfs: pathlib.Path, scratch: pathlib.Path) -> None:
    tree = load_directory(debian_rootfs)
    img = scratch / "debian.erofs"
    st = write_image(tree, img)
    assert st.inodes > 5000 and st.files > 5000
    fsck_erofs(img)
    expected = snapshot_dir(debian_rootfs)
    with mounted_erofs(img) as mp:
        assert_same(snapshot_dir(mp), expected)
        assert os.path.exists(os.path.join(mp, "usr/bin/python3"))
    again = scratch / "again.erofs"
    write_image(scan_directory(debian_rootfs), again, WriterOptions(threaded=False))
    assert again.read_bytes() == img.read_bytes()


@pytest.mark.network
@pytest.mark.slow
def test_build_debian_rootfs_cache() -> None:
    """Build (or rebuild) the cached Debian rootfs tarball the other tests use."""
    if os.geteuid() != 0:
        pytest.skip("mmdebstrap as used here needs root")
    if not DEBIAN_TAR.exists():
        build_debian_tar()
    assert DEBIAN_TAR.stat().st_size > 100 << 20


@pytest.mark.root
@pytest.mark.mount
def test_hardlinks_across_many_directories_are_one_inode(scratch: pathlib.Path) -> None:
    # Directories are read by two threads: a file linked from everywhere must still
    # become one inode, whichever thread sees it first.
    src = scratch / "src"
    src.mkdir()
    (src / "target").write_bytes(b"shared")
    for i in range(300):
        (src / f"d{i}" / "sub").mkdir(parents=True)
        os.link(src / "target", src / f"d{i}" / "sub" / "link")
        (src / f"d{i}" / "own").write_bytes(b"%d" % i)
    for attempt in range(3):
        tree = scan_directory(src).tree()
        target = tree.get("target")
        assert all(tree.get(f"d{i}/sub/link") is target for i in range(300)), attempt
        assert tree.get("d7/own").data is not None  # type: ignore[union-attr]
    img = scratch / "img.erofs"
    write_image(scan_directory(src), img)
    fsck_erofs(img)
    with mounted_erofs(img) as mp:
        st = os.stat(os.path.join(mp, "target"))
        assert st.st_nlink == 301
        assert os.stat(os.path.join(mp, "d299/sub/link")).st_ino == st.st_ino
        assert pathlib.Path(mp, "d42/own").read_bytes() == b"42"
