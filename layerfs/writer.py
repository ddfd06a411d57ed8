"""Write a :class:`layerfs.tree.Tree` as an uncompressed EROFS image.

The C writer (``csrc/lib/writer.c``) does the work: validation, sorting, layout,
directory blocks, inode encoding and the data copy. This module flattens the tree into
four packed arrays and one byte blob (a few calls, not one per field) and hands them
over. Output is deterministic: the same tree content gives the same bytes whatever the
order of ``children`` or ``xattrs`` dicts (format facts: ``csrc/include/erofs_fs.h``,
``shared/reference/erofs-format.md``).
"""

from __future__ import annotations

import os
import stat
import struct

from layerfs.errors import ImageFormatError
from layerfs.native import TYPE_CHECKING, ffi, lib, named_tuple, new_error, raise_error

if TYPE_CHECKING:  # not imported when run: a directory build needs none (start-up time)
    from typing import Any, NamedTuple, Protocol

    from layerfs.tree import Inode, Tree
else:
    NamedTuple = Protocol = object   # see layerfs.native.named_tuple

__all__ = ["ImageStats", "WriterInput", "WriterOptions", "write_image"]

# Packed mirrors of struct lfs_wr_inode / _dirent / _xattr / _extent (lfs_writer.h);
# layerfs.sources.directory reads scans with them too.
INODE = struct.Struct("<qQQQ16IQQQqII")
DIRENT = struct.Struct("<QII")
XATTR = struct.Struct("<QQII")
EXTENT = struct.Struct("<QQQ")
_NO_DIRENT = 0xFFFFFFFF
_NS = 1_000_000_000
_MAX_SEC = (1 << 63) - 1  # int64_t seconds in struct lfs_wr_options

for _s, _c in ((INODE, "struct lfs_wr_inode"), (DIRENT, "struct lfs_wr_dirent"),
               (XATTR, "struct lfs_wr_xattr"), (EXTENT, "struct lfs_wr_extent")):
    if _s.size != ffi.sizeof(_c):  # pragma: no cover - a header/packing mismatch
        raise ImportError(f"layerfs.writer: {_c} is {ffi.sizeof(_c)} bytes, not {_s.size}")


@named_tuple
class WriterOptions(NamedTuple):
    """How to write an image (immutable; ``opts._replace(chunk_align=0)`` for a
    changed copy).

    - ``block_size``: bytes; only 4096 is supported (EROFS allows 512..PAGE_SIZE).
    - ``chunk_align``: bytes, a power of two >= ``block_size``, or 0. Regular files of
      at least this size start at an image offset that is a multiple of it, so the same
      large file in two layers falls into identical store chunks; smaller files are
      packed. The alignment gaps are holes in the output file.
    - ``clamp_mtime_ns``: ``SOURCE_DATE_EPOCH``-style: mtimes later than this (ns since
      the Unix epoch) are written as this.
    - ``epoch``: the superblock epoch in seconds (compact inodes carry exactly this
      mtime). ``None`` picks the most common mtime of the tree, which keeps the most
      inodes compact.
    - ``uuid``: 16 bytes, or ``None`` for a version-8 uuid hashed from the metadata.
    - ``volume_name``: at most 15 bytes (the kernel requires a NUL within 16).
    - ``threaded``: write the image from a second thread while this one reads the
      sources (two cores; the bytes are the same either way).
    """

    block_size: int = 4096
    chunk_align: int = 1 << 20
    clamp_mtime_ns: int | None = None
    epoch: int | None = None
    uuid: bytes | None = None
    volume_name: bytes = b""
    threaded: bool = True


@named_tuple
class ImageStats(NamedTuple):
    """What :func:`write_image` wrote (``stats._asdict()`` for a dict): ``size`` (image
    bytes), ``inodes``, ``files`` (regular files), ``data_bytes`` (sum of regular file
    sizes), ``meta_bytes`` (superblock, inodes and inline data, block-rounded),
    ``blocks``, the ``epoch`` chosen (seconds) and the ``uuid`` written."""

    size: int
    inodes: int
    files: int
    data_bytes: int
    meta_bytes: int
    blocks: int
    epoch: int
    uuid: bytes


class WriterInput(Protocol):
    """What the C writer takes as is: a flattened tree (a :class:`Tree` is flattened by
    :func:`write_image`; :class:`layerfs.sources.directory.DirScan` is one already)."""

    def writer_input(self) -> Any:
        """A cffi ``struct lfs_wr_input *`` (``lfs_writer.h``), valid while ``self``
        lives."""


class _Flat:
    """A tree as the C writer's arrays (struct lfs_wr_input)."""

    def __init__(self, tree: Tree) -> None:
        self.blob = bytearray()
        self.nodes: list[Inode] = [tree.root]
        self.parent: list[int] = [0]
        self.name_dirent: list[int] = [_NO_DIRENT]
        self.names: list[bytes] = []  # per dirent, for messages
        inodes: list[bytes] = []
        dirents: list[bytes] = []
        xattrs: list[bytes] = []
        extents: list[bytes] = []
        index = {id(tree.root): 0}
        paths: dict[str, int] = {}
        blob = self.blob

        i = 0
        while i < len(self.nodes):
            node = self.nodes[i]
            dfirst = len(dirents)
            if node.children is not None:
                if not node.is_dir:
                    raise ImageFormatError(f"entry {self.path(i)}: a non-directory has children")
                for name, child in node.children.items():
                    if not isinstance(name, bytes):
                        raise ImageFormatError(
                            f"entry {self.path(i)}: child name {name!r} is not bytes")
                    j = index.get(id(child))
                    if j is None:
                        j = index[id(child)] = len(self.nodes)
                        self.nodes.append(child)
                        self.parent.append(i)
                        self.name_dirent.append(len(dirents))
                    dirents.append(DIRENT.pack(len(blob), len(name), j))
                    self.names.append(name)
                    blob += name
            xfirst = len(xattrs)
            for xname, xvalue in node.xattrs.items():
                xattrs.append(XATTR.pack(len(blob), len(blob) + len(xname), len(xname),
                                          len(xvalue)))
                blob += xname
                blob += xvalue
            efirst = len(extents)
            flags = str_off = str_len = src_offset = 0
            sid: tuple[int, ...] = (0, 0, 0, 0, 0, 0)
            size = 0
            fmt = stat.S_IFMT(node.mode)
            if fmt == stat.S_IFREG:
                size = node.size
                if node.data is not None:
                    spath = os.fspath(node.data.path)
                    off = paths.get(spath)
                    raw = os.fsencode(spath)
                    if off is None:
                        off = paths[spath] = len(blob)
                        blob += raw
                    str_off, str_len = off, len(raw)
                    src_offset = node.data.offset
                    ident = node.data.identity
                    if ident is not None:
                        flags |= lib.LFS_WR_SRC_ID
                        sid = (ident.dev, ident.ino, ident.size,
                               *divmod(ident.mtime_ns, _NS), 0)
                    if node.data.extents is not None:
                        flags |= lib.LFS_WR_SPARSE
                        for ext in node.data.extents:
                            extents.append(EXTENT.pack(*ext))
                elif size:
                    raise ImageFormatError(
                        f"entry {self.path(i)}: regular file of {size} bytes without data")
            elif fmt == stat.S_IFLNK:
                if not isinstance(node.target, bytes):
                    raise ImageFormatError(f"entry {self.path(i)}: symlink without a target")
                str_off, str_len = len(blob), len(node.target)
                blob += node.target
            sec, nsec = divmod(node.mtime_ns, _NS)
            try:
                inodes.append(INODE.pack(
                    sec, size, src_offset, str_off, str_len, node.mode, node.uid, node.gid,
                    nsec, node.rdev_major, node.rdev_minor, flags,
                    dfirst, len(dirents) - dfirst, xfirst, len(xattrs) - xfirst,
                    efirst, len(extents) - efirst, self.parent[i], self.name_dirent[i], *sid))
            except struct.error as exc:
                raise ImageFormatError(
                    f"entry {self.path(i)}: a field is out of range ({exc})") from None
            i += 1
        self.inodes = b"".join(inodes)
        self.dirents = b"".join(dirents)
        self.xattrs = b"".join(xattrs)
        self.extents = b"".join(extents)
        self.counts = (len(inodes), len(dirents), len(xattrs), len(extents))

    def writer_input(self) -> Any:
        inp = ffi.new("struct lfs_wr_input *")
        self._keep = [_array("struct lfs_wr_inode[]", self.inodes),
                      _array("struct lfs_wr_dirent[]", self.dirents),
                      _array("struct lfs_wr_xattr[]", self.xattrs),
                      _array("struct lfs_wr_extent[]", self.extents),
                      _array("uint8_t[]", bytes(self.blob))]
        inp.inodes, inp.dirents, inp.xattrs, inp.extents, inp.blob = self._keep
        inp.blob_len = len(self.blob)
        inp.ninodes, inp.ndirents, inp.nxattrs, inp.nextents = self.counts
        return inp

    def path(self, i: int) -> str:
        """Human path of node ``i`` (first name it was reached by)."""
        parts: list[bytes] = []
        while i and len(parts) < 4096:
            parts.append(self.names[self.name_dirent[i]])
            i = self.parent[i]
        return "/" + b"/".join(reversed(parts)).decode("utf-8", "backslashreplace")


def _array(ctype: str, data: bytes) -> Any:
    return ffi.from_buffer(ctype, data) if data else ffi.NULL


def _write_fd(flat: WriterInput, fd: int, options: WriterOptions, *,
              writeback: bool = False) -> ImageStats:
    inp = flat.writer_input()
    opt = ffi.new("struct lfs_wr_options *")
    if writeback:  # the caller fsyncs: start writeback early, leave it less to wait for
        opt.flags |= lib.LFS_WR_OPT_WRITEBACK
    if not options.threaded:
        opt.flags |= lib.LFS_WR_OPT_ONE_THREAD
    opt.block_size = options.block_size
    opt.chunk_align = options.chunk_align
    if options.epoch is not None:
        if not 0 <= options.epoch <= _MAX_SEC:
            raise ImageFormatError(f"epoch {options.epoch} is out of range (0..{_MAX_SEC} s)")
        opt.flags |= lib.LFS_WR_OPT_EPOCH
        opt.epoch_sec = options.epoch
    if options.clamp_mtime_ns is not None:
        if not -_MAX_SEC <= options.clamp_mtime_ns // _NS <= _MAX_SEC:
            raise ImageFormatError(
                f"clamp_mtime_ns {options.clamp_mtime_ns} is out of range (64-bit seconds)")
        opt.flags |= lib.LFS_WR_OPT_CLAMP
        opt.clamp_sec, opt.clamp_nsec = divmod(options.clamp_mtime_ns, _NS)
    if options.uuid is not None:
        if len(options.uuid) != 16:
            raise ImageFormatError("uuid must be 16 bytes")
        opt.flags |= lib.LFS_WR_OPT_UUID
        ffi.memmove(opt.uuid, options.uuid, 16)
    if len(options.volume_name) > 15 or b"\0" in options.volume_name:
        raise ImageFormatError("volume_name must be at most 15 bytes without NUL")
    ffi.memmove(opt.volume_name, options.volume_name, len(options.volume_name))

    st = ffi.new("struct lfs_wr_stats *")
    err = new_error()
    if lib.lfs_writer_write(inp, opt, fd, st, err) < 0:
        raise_error(err, "write EROFS image")
    return ImageStats(size=st.size, inodes=st.inodes, files=st.files,
                      data_bytes=st.data_bytes, meta_bytes=st.meta_bytes, blocks=st.blocks,
                      epoch=st.epoch_sec, uuid=bytes(ffi.buffer(st.uuid, 16)))


def write_image(tree: Tree | WriterInput, out: str | os.PathLike[str] | int,
                options: WriterOptions | None = None, *,
                writeback: bool | None = None) -> ImageStats:
    """Write ``tree`` (a :class:`Tree`, or a :class:`WriterInput` such as a directory
    scan) as an EROFS image to ``out`` and return its :class:`ImageStats`.

    ``out`` is a path (written to a temporary file beside it and renamed into place,
    so a failed build leaves nothing; an existing path that is not a regular file, e.g.
    a device, symlink or directory, is refused with :class:`~layerfs.output.OutputError`
    and left alone; see :mod:`layerfs.output`) or an open, seekable file descriptor
    (truncated and written from offset 0; left as is on failure; not synced).
    ``writeback`` starts the writeback of the image while it is written, for a caller
    that will fsync it (default: only for a path, which is fsynced before its
    rename). Regular file bytes are copied by the C side from each file's
    :class:`layerfs.tree.Data` source through a few 128 KiB buffers, written by a second
    thread (see :attr:`WriterOptions.threaded`); memory does not grow with file size.

    Raises :class:`ImageFormatError` (a ``ValueError``) for input EROFS or the writer
    refuses (bad names, modes, sizes, xattr names; the message names the entry) and
    :class:`NativeError` (an ``OSError``) for I/O errors, e.g. a source file that
    vanished or shrank (the message names it).
    """
    options = options or WriterOptions()
    # A Tree has no writer_input (and is not imported here: start-up time).
    flat: WriterInput = tree if hasattr(tree, "writer_input") else _Flat(tree)
    if isinstance(out, int):
        return _write_fd(flat, out, options, writeback=bool(writeback))
    from layerfs.output import atomic_output

    with atomic_output(out) as fd:
        stats = _write_fd(flat, fd, options, writeback=writeback is not False)
    return stats
