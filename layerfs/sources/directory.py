"""A host directory as a layer: scanned in C straight into the writer's input.

The scan (``csrc/lib/scan.c``, contract in ``csrc/include/lfs_scan.h``) uses ``lstat``
and never follows a symlink. It keeps what a layer must carry: modes (with
setuid/setgid/sticky), owners, mtimes in nanoseconds, xattrs of every namespace
byte-exact (``trusted.*`` and ``security.capability`` need root to read), device numbers,
hardlinks (same ``(st_dev, st_ino)`` → one inode) and holes of sparse files
(``SEEK_DATA``/``SEEK_HOLE``, lseek(2)). File bytes are not read: each regular file
points at itself, and the writer reads it later and refuses one that changed in between
(its ``lstat`` identity is kept: a swapped, grown or rewritten file, or a symlink or
device put in its place, is an error naming it). A directory that changes identity
during the scan is an error too. A 0:0 character device (an overlay upper directory's
whiteout) is kept as is, xattrs as the host has them.

:func:`scan_directory` gives a :class:`DirScan`, which :func:`layerfs.writer.write_image`
writes with no per-entry Python work (what ``layerfs build DIR`` does);
:func:`load_directory` turns the same scan into a :class:`~layerfs.tree.Tree` for code
that wants to look at or change the tree.
"""

from __future__ import annotations

import errno
import os
import stat

from layerfs.errors import InvalidSourceError
from layerfs.native import TYPE_CHECKING, ffi, lib, new_error, raise_error

if TYPE_CHECKING:  # imported in tree(): a build from the scan needs neither module
    from typing import Any

    from layerfs.tree import Tree

__all__ = ["DirScan", "load_directory", "scan_directory"]

_NS = 1_000_000_000


class DirScan:
    """A scanned host directory: the C writer's input (a
    :class:`~layerfs.writer.WriterInput`), freed with this object. ``path`` is the
    directory scanned; ``inodes`` the number of inodes found."""

    def __init__(self, handle: Any, path: str) -> None:
        self._handle = handle
        self.path = path
        self.inodes = int(lib.lfs_scan_input(handle).ninodes)

    def writer_input(self) -> Any:
        """The ``struct lfs_wr_input *`` of the scan (valid while this object lives)."""
        return lib.lfs_scan_input(self._handle)

    def tree(self) -> Tree:
        """The scan as a new :class:`~layerfs.tree.Tree` (hardlinks as shared inodes)."""
        from layerfs.tree import Data, Inode, SourceId, Tree
        from layerfs.writer import DIRENT, EXTENT, INODE, XATTR

        inp = self.writer_input()

        def table(ptr: Any, count: int, fmt: Any) -> list[tuple[Any, ...]]:
            if not count:
                return []
            return list(fmt.iter_unpack(ffi.buffer(ptr, count * fmt.size)))

        blob = bytes(ffi.buffer(inp.blob, inp.blob_len)) if inp.blob_len else b""
        rows = table(inp.inodes, inp.ninodes, INODE)
        dirents = table(inp.dirents, inp.ndirents, DIRENT)
        xattrs = table(inp.xattrs, inp.nxattrs, XATTR)
        extents = table(inp.extents, inp.nextents, EXTENT)
        nodes: list[Inode] = []
        for (mtime_sec, size, _src_offset, str_off, str_len, mode, uid, gid, mtime_nsec,
             major, minor, flags, _dfirst, _dcount, xfirst, xcount, efirst, ecount,
             _parent, _name_dirent, dev, ino, src_size, src_sec, src_nsec, _) in rows:
            node = Inode(mode=mode, uid=uid, gid=gid, mtime_ns=mtime_sec * _NS + mtime_nsec,
                         xattrs={blob[n:n + nl]: blob[v:v + vl]
                                 for n, v, nl, vl in xattrs[xfirst:xfirst + xcount]})
            fmt = stat.S_IFMT(mode)
            if fmt == stat.S_IFREG:
                node.size = size
                ext = (tuple(extents[efirst:efirst + ecount])
                       if flags & lib.LFS_WR_SPARSE else None)
                node.data = Data(os.fsdecode(blob[str_off:str_off + str_len]), 0, ext,
                                 SourceId(dev, ino, src_size, src_sec * _NS + src_nsec))
            elif fmt == stat.S_IFLNK:
                node.target = blob[str_off:str_off + str_len]
                node.size = str_len
            elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
                node.rdev_major, node.rdev_minor = major, minor
            elif fmt == stat.S_IFDIR:
                node.children = {}
            nodes.append(node)
        for row, node in zip(rows, nodes, strict=True):
            if node.children is not None:
                dfirst, dcount = row[12], row[13]
                for name_off, name_len, child in dirents[dfirst:dfirst + dcount]:
                    node.children[blob[name_off:name_off + name_len]] = nodes[child]
        return Tree(nodes[0])


def scan_directory(path: str | os.PathLike[str] | bytes) -> DirScan:
    """Scan the directory ``path`` (recursively, without following symlinks).

    The image written from it does not depend on readdir or listxattr order, nor on
    which of the scan's two threads read which directory. Raises
    :class:`InvalidSourceError` if ``path`` is not a directory (a symlink to one is not)
    or an entry changed during the scan or cannot be kept, and ``OSError`` for
    unreadable entries (the message names them).
    """
    raw = os.fsencode(path)
    out = ffi.new("struct lfs_scan **")
    err = new_error()
    if lib.lfs_scan_dir(raw, out, err) < 0:
        if err.code == errno.ENOTDIR:
            raise InvalidSourceError(ffi.string(err.msg).decode("utf-8", "replace"))
        raise_error(err, "scan directory", refused=InvalidSourceError)
    return DirScan(ffi.gc(out[0], lib.lfs_scan_free), os.fsdecode(raw))


def load_directory(path: str | os.PathLike[str] | bytes) -> Tree:
    """Read the directory ``path`` into a :class:`Tree` whose root carries the
    directory's own metadata (see :func:`scan_directory` for what is kept and the
    errors raised)."""
    return scan_directory(path).tree()
