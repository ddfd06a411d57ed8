"""A host directory as a layer :class:`~layerfs.tree.Tree`.

The walk uses ``lstat`` and never follows a symlink. It keeps what a layer must carry:
modes (with setuid/setgid/sticky), owners, mtimes in nanoseconds, xattrs of every
namespace byte-exact (``trusted.*`` and ``security.capability`` need root to read),
device numbers, hardlinks (same ``(st_dev, st_ino)`` → the same :class:`Inode`) and
holes of sparse files (``SEEK_DATA``/``SEEK_HOLE``, lseek(2)). File bytes are not read:
each regular file gets a :class:`~layerfs.tree.Data` pointing at itself, and the writer
reads it later and refuses one that changed in between (its ``lstat`` identity is kept
in :attr:`Data.identity <layerfs.tree.Data>`: a swapped, grown or rewritten file, or a
symlink or device put in its place, is an error naming it).
"""

from __future__ import annotations

import errno
import os
import stat

from layerfs.errors import InvalidSourceError
from layerfs.tree import Data, Inode, SourceId, Tree

__all__ = ["load_directory"]

_NO_XATTRS = (errno.ENOTSUP, errno.ENODATA)


def _xattrs(path: bytes) -> dict[bytes, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _NO_XATTRS:
            return {}
        raise
    out: dict[bytes, bytes] = {}
    for name in sorted(names):
        try:
            out[os.fsencode(name)] = os.getxattr(path, name, follow_symlinks=False)
        except OSError as exc:
            if exc.errno == errno.ENODATA:  # removed between list and get
                continue
            raise
    return out


def _extents(path: bytes, size: int) -> tuple[tuple[int, int, int], ...] | None:
    """Data extents of a file with holes, or None if it has none (lseek(2))."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out: list[tuple[int, int, int]] = []
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole from pos to the end
                    break
                raise
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.append((start, end - start, start))
            pos = end
    finally:
        os.close(fd)
    if len(out) == 1 and out[0][:2] == (0, size):
        return None
    return tuple(out)


def _inode(path: bytes, st: os.stat_result) -> Inode:
    mode = st.st_mode
    node = Inode(mode=mode, uid=st.st_uid, gid=st.st_gid, mtime_ns=st.st_mtime_ns,
                 xattrs=_xattrs(path))
    if stat.S_ISREG(mode):
        node.size = st.st_size
        extents = None
        # Fewer allocated bytes than the size means holes (or inline/compressed
        # storage; then SEEK_DATA just reports one extent).
        if st.st_size and st.st_blocks * 512 < st.st_size:
            extents = _extents(path, st.st_size)
        node.data = Data(os.fsdecode(path), 0, extents, SourceId.of(st))
    elif stat.S_ISLNK(mode):
        node.target = os.readlink(path)
        node.size = len(node.target)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        node.rdev_major, node.rdev_minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    elif stat.S_ISDIR(mode):
        node.children = {}
    return node


def load_directory(path: str | os.PathLike[str] | bytes) -> Tree:
    """Read the directory ``path`` (recursively, without following symlinks) into a
    :class:`Tree` whose root carries the directory's own metadata.

    The result does not depend on readdir or listxattr order (children and xattrs are
    inserted sorted; the writer sorts anyway). Raises :class:`InvalidSourceError` if
    ``path`` is not a directory and ``OSError`` for unreadable entries (the message
    names them).
    """
    top = os.fsencode(path)
    st = os.lstat(top)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidSourceError(f"{os.fsdecode(top)}: not a directory")
    root = _inode(top, st)
    tree = Tree(root)
    links: dict[tuple[int, int], Inode] = {}
    stack: list[tuple[bytes, Inode]] = [(top, root)]
    while stack:
        dpath, dnode = stack.pop()
        assert dnode.children is not None
        with os.scandir(dpath) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            name, cpath = entry.name, entry.path
            cst = entry.stat(follow_symlinks=False)
            key = (cst.st_dev, cst.st_ino)
            if not stat.S_ISDIR(cst.st_mode) and cst.st_nlink > 1:
                node = links.get(key)
                if node is None:
                    node = links[key] = _inode(cpath, cst)
            else:
                node = _inode(cpath, cst)
            dnode.children[name] = node
            if node.children is not None:
                stack.append((cpath, node))
    return tree
