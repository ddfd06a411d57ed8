"""Compare a directory tree (e.g. a mounted image) with a source tree or a Tree object.

A snapshot maps every path (bytes, relative, the root as ``b""``) to an :class:`Entry`
holding everything a layer must preserve: type and mode bits, owners, mtime in ns,
size (not for directories: each filesystem sizes them its own way), link count, device
numbers, symlink target, xattrs and a sha256 of regular file bytes. Hardlink identity is
compared as groups: the set of paths sharing an inode.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
from dataclasses import dataclass

from layerfs.tree import Inode, Tree


@dataclass(frozen=True)
class Entry:
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int | None
    nlink: int
    rdev: tuple[int, int]
    target: bytes | None
    xattrs: tuple[tuple[bytes, bytes], ...]
    digest: str | None
    links: tuple[bytes, ...]  # every path of this inode (hardlinks), sorted


Snapshot = dict[bytes, Entry]


def _hash_file(path: bytes | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _xattrs(path: bytes) -> tuple[tuple[bytes, bytes], ...]:
    names = os.listxattr(path, follow_symlinks=False)
    return tuple(sorted((os.fsencode(n), os.getxattr(path, n, follow_symlinks=False))
                        for n in names))


def snapshot_dir(root: str | bytes) -> Snapshot:
    """Snapshot the tree under ``root`` (lstat, symlinks not followed)."""
    top = os.fsencode(root)
    raw: dict[bytes, tuple[os.stat_result, bytes]] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        full = os.path.join(top, rel) if rel else top
        st = os.lstat(full)
        raw[rel] = (st, full)
        if stat.S_ISDIR(st.st_mode):
            for name in os.listdir(full):
                stack.append(os.path.join(rel, name) if rel else name)
    groups: dict[tuple[int, int], list[bytes]] = {}
    for rel, (st, _) in raw.items():
        if not stat.S_ISDIR(st.st_mode):
            groups.setdefault((st.st_dev, st.st_ino), []).append(rel)
    out: Snapshot = {}
    for rel, (st, full) in raw.items():
        mode = st.st_mode
        isdir = stat.S_ISDIR(mode)
        out[rel] = Entry(
            mode=mode, uid=st.st_uid, gid=st.st_gid, mtime_ns=st.st_mtime_ns,
            size=None if isdir else st.st_size, nlink=st.st_nlink,
            rdev=(os.major(st.st_rdev), os.minor(st.st_rdev))
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else (0, 0),
            target=os.readlink(full) if stat.S_ISLNK(mode) else None,
            xattrs=_xattrs(full),
            digest=_hash_file(full) if stat.S_ISREG(mode) else None,
            links=() if isdir else tuple(sorted(groups[(st.st_dev, st.st_ino)])),
        )
    return out


def _tree_digest(node: Inode) -> str:
    h = hashlib.sha256()
    if node.size == 0:
        return h.hexdigest()
    assert node.data is not None
    extents = node.data.extents
    if extents is None:
        extents = ((0, node.size, node.data.offset),)
    with open(node.data.path, "rb") if extents else io.BytesIO() as f:
        pos = 0
        for off, length, src in extents:
            zeros = off - pos
            while zeros:
                n = min(zeros, 1 << 20)
                h.update(bytes(n))
                zeros -= n
            f.seek(src)
            left = length
            while left:
                chunk = f.read(min(left, 1 << 20))
                assert chunk, f"{node.data.path}: short"
                h.update(chunk)
                left -= len(chunk)
            pos = off + length
        zeros = node.size - pos
        while zeros:
            n = min(zeros, 1 << 20)
            h.update(bytes(n))
            zeros -= n
    return h.hexdigest()


def snapshot_tree(tree: Tree) -> Snapshot:
    """The snapshot a faithful image of ``tree`` must give when mounted."""
    paths: dict[int, list[bytes]] = {}
    items = list(tree.walk())
    for parts, node in items:
        paths.setdefault(id(node), []).append(b"/".join(parts))
    out: Snapshot = {}
    for parts, node in items:
        rel = b"/".join(parts)
        mode = node.mode
        isdir = stat.S_ISDIR(mode)
        nsub = sum(1 for c in (node.children or {}).values() if c.is_dir)
        out[rel] = Entry(
            mode=mode, uid=node.uid, gid=node.gid, mtime_ns=node.mtime_ns,
            size=None if isdir else (len(node.target or b"") if stat.S_ISLNK(mode)
                                     else node.size if stat.S_ISREG(mode) else 0),
            nlink=2 + nsub if isdir else len(paths[id(node)]),
            rdev=(node.rdev_major, node.rdev_minor)
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else (0, 0),
            target=node.target if stat.S_ISLNK(mode) else None,
            xattrs=tuple(sorted(node.xattrs.items())),
            digest=_tree_digest(node) if stat.S_ISREG(mode) else None,
            links=() if isdir else tuple(sorted(paths[id(node)])),
        )
    return out


def diff(actual: Snapshot, expected: Snapshot, limit: int = 20) -> list[str]:
    """Human-readable differences (at most ``limit``); empty when equal."""
    out: list[str] = []
    for rel in sorted(set(actual) | set(expected)):
        a, e = actual.get(rel), expected.get(rel)
        name = "/" + rel.decode("utf-8", "backslashreplace")
        if a is None:
            out.append(f"{name}: missing")
        elif e is None:
            out.append(f"{name}: unexpected")
        elif a != e:
            fields = [f"{k}: {getattr(a, k)!r} != {getattr(e, k)!r}"
                      for k in Entry.__dataclass_fields__ if getattr(a, k) != getattr(e, k)]
            out.append(f"{name}: " + "; ".join(fields))
        if len(out) >= limit:
            out.append("...")
            break
    return out


def assert_same(actual: Snapshot, expected: Snapshot) -> None:
    """Fail with the differences listed unless the snapshots are equal."""
    d = diff(actual, expected)
    assert not d, "trees differ:\n" + "\n".join(d)
