"""The in-memory tree of a layer: what every source produces and the writer consumes.

A :class:`Tree` holds :class:`Inode` objects; a directory inode maps child names
(``bytes``) to inodes. A hardlink is the same :class:`Inode` object under two names, so
link identity and ``nlink`` follow from object identity. File contents are not held in
memory: a regular file carries a :class:`Data` reference (a host file and offset) that the
C writer streams from when it writes the image.

Path rule (documented in the README, applied to every source): a path is split on ``/``;
empty components and ``.`` are dropped; ``..`` removes the previous component and is
ignored at the root, so no path can name anything outside the layer root (``../../etc``
and ``/etc`` both mean ``etc``). A component containing NUL or longer than 255 bytes is
rejected, except that the last one may be an OCI whiteout marker ``.wh.NAME`` of up to
259 bytes: ``NAME`` itself fits the 255 bytes, docker writes and applies such markers,
and they never reach an image as names (:mod:`layerfs.sources.whiteout` converts them;
the writer refuses any name over 255 bytes). Symlinks are never followed while placing
entries: an entry whose parent is a symlink, or any other non-directory, is rejected.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from layerfs.errors import InvalidSourceError

NAME_MAX = 255  # EROFS_NAME_LEN, linux/limits.h NAME_MAX
WHITEOUT_PREFIX = b".wh."  # OCI image-spec layer.md, "Whiteouts"


@dataclass(frozen=True, slots=True)
class SourceId:
    """What a source file was when it was scanned: ``st_dev``, ``st_ino``, ``st_size``
    (bytes, of the whole source file) and ``st_mtime_ns``. The writer refuses a source
    that no longer matches (swapped, grown, shrunk or rewritten between the scan and the
    write)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> SourceId:
        """The identity recorded by ``st`` (an ``os.stat``/``os.fstat`` result)."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class Data:
    """Where a regular file's bytes come from.

    ``path`` is a host file (the file itself for a directory source, a spooled archive for
    a tar source). Without ``extents`` the file's ``size`` bytes are at ``offset`` in it.
    With ``extents`` (sparse files) each ``(file_offset, length, source_offset)`` triple
    places ``length`` bytes; they are sorted, do not overlap, and everything outside them
    is a hole that reads as zeros; ``extents == ()`` is a file that is all hole, and
    ``path`` is then never read (it may be ``""``).

    ``identity``, if given, is the :class:`SourceId` of ``path`` at scan time; the writer
    then refuses the file if ``path`` is no longer that file. Whatever ``identity``, the
    writer never follows a symlink at ``path`` and reads only a regular file there.
    """

    path: str
    offset: int = 0
    extents: tuple[tuple[int, int, int], ...] | None = None
    identity: SourceId | None = None


@dataclass(eq=False, slots=True)
class Inode:
    """One inode of the layer.

    ``mode`` is a full ``st_mode`` (type and permission bits, including setuid, setgid
    and sticky). ``mtime_ns`` is nanoseconds since the Unix epoch and may be negative.
    ``size`` is the byte size for a regular file and ``len(target)`` for a symlink; the
    writer computes directory sizes. ``rdev_major``/``rdev_minor`` are for character and
    block devices (a 0:0 character device is an overlay whiteout). ``xattrs`` maps full
    names (``b"security.capability"``) to raw values. ``implicit`` marks a directory that
    no source entry described: a missing parent (or the root) made up by
    :meth:`Tree.put` with default metadata; flattening and per-layer OCI conversion let
    it take the metadata of the same directory in the layers below
    (:mod:`layerfs.sources.whiteout`). An explicit entry for it clears the mark.
    """

    mode: int
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    rdev_major: int = 0
    rdev_minor: int = 0
    target: bytes | None = None
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    data: Data | None = None
    children: dict[bytes, Inode] | None = None
    implicit: bool = False

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_whiteout(self) -> bool:
        """True for an overlayfs whiteout (a 0:0 character device)."""
        return stat.S_ISCHR(self.mode) and self.rdev_major == 0 and self.rdev_minor == 0


def new_dir(mode: int = 0o755, uid: int = 0, gid: int = 0, mtime_ns: int = 0) -> Inode:
    """A fresh, empty directory inode (``mode`` holds permission bits only)."""
    return Inode(mode=stat.S_IFDIR | (mode & 0o7777), uid=uid, gid=gid, mtime_ns=mtime_ns,
                 children={})


def split_path(path: str | bytes) -> tuple[bytes, ...]:
    """Normalise ``path`` to its components inside the layer root (see the module rule).

    Returns ``()`` for the root itself. Raises :class:`InvalidSourceError` for a NUL
    byte or a component longer than 255 bytes (a last component ``.wh.NAME``: longer
    than 259).
    """
    raw = path.encode("utf-8", "surrogateescape") if isinstance(path, str) else bytes(path)
    if b"\0" in raw:
        raise InvalidSourceError(f"path {_text(raw)!r}: contains a NUL byte")
    parts: list[bytes] = []
    comps = raw.split(b"/")
    while comps and comps[-1] in (b"", b"."):
        comps.pop()
    for i, comp in enumerate(comps):
        if comp in (b"", b"."):
            continue
        if comp == b"..":
            if parts:
                parts.pop()
            continue
        if len(comp) > NAME_MAX and not (
                i == len(comps) - 1 and comp.startswith(WHITEOUT_PREFIX)
                and len(comp) <= NAME_MAX + len(WHITEOUT_PREFIX)):
            raise InvalidSourceError(
                f"path {_text(raw)!r}: component longer than {NAME_MAX} bytes")
        parts.append(comp)
    return tuple(parts)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def display(parts: tuple[bytes, ...]) -> str:
    """Human form of a normalised path, for messages."""
    return "/" + b"/".join(parts).decode("utf-8", "backslashreplace")


class Tree:
    """A layer's directory tree, rooted at :attr:`root`.

    Mutations follow tar extraction semantics so that sources can apply entries in
    archive order: the last entry for a path wins, except that a directory replacing a
    directory only updates its metadata and keeps the children.
    """

    def __init__(self, root: Inode | None = None) -> None:
        if root is None:
            root = new_dir()
            root.implicit = True  # until a source entry describes "/"
        self.root = root
        if not self.root.is_dir:
            raise ValueError("the root of a tree must be a directory")

    def _parent(self, parts: tuple[bytes, ...], *, create: bool,
                default_mtime_ns: int = 0) -> Inode | None:
        node = self.root
        for i, comp in enumerate(parts[:-1]):
            assert node.children is not None
            child = node.children.get(comp)
            if child is None:
                if not create:
                    return None
                child = new_dir(mtime_ns=default_mtime_ns)
                child.implicit = True
                node.children[comp] = child
            elif not child.is_dir:
                kind = "a symlink" if stat.S_ISLNK(child.mode) else "not a directory"
                raise InvalidSourceError(
                    f"entry {display(parts)}: parent {display(parts[: i + 1])} is {kind}")
            node = child
        return node

    def get(self, path: str | bytes | tuple[bytes, ...]) -> Inode | None:
        """The inode at ``path`` (no symlink is followed), or None."""
        parts = path if isinstance(path, tuple) else split_path(path)
        if not parts:
            return self.root
        children = self._existing_children(parts)
        return None if children is None else children.get(parts[-1])

    def _existing_children(self, parts: tuple[bytes, ...]) -> dict[bytes, Inode] | None:
        """The child map of the existing parent directory of ``parts``, or None."""
        try:
            parent = self._parent(parts, create=False)
        except InvalidSourceError:
            return None
        return None if parent is None else parent.children

    def put(self, path: str | bytes | tuple[bytes, ...], inode: Inode, *,
            implicit_mtime_ns: int = 0) -> None:
        """Place ``inode`` at ``path``, creating missing parent directories (mode 0755,
        owner 0:0, mtime ``implicit_mtime_ns``, marked :attr:`Inode.implicit`; in a
        single layer with nothing below, that is the metadata they keep).

        An existing entry is replaced; a directory put over a directory keeps the old
        children. Putting a directory at the root updates the root's metadata. Raises
        :class:`InvalidSourceError` if a parent is not a directory.
        """
        parts = path if isinstance(path, tuple) else split_path(path)
        if inode.is_dir and inode.children is None:
            inode.children = {}
        if not parts:
            if not inode.is_dir:
                raise InvalidSourceError("entry /: the layer root must be a directory")
            self._merge_dir(self.root, inode)
            return
        parent = self._parent(parts, create=True, default_mtime_ns=implicit_mtime_ns)
        assert parent is not None and parent.children is not None
        old = parent.children.get(parts[-1])
        if old is not None and old.is_dir and inode.is_dir and old is not inode:
            self._merge_dir(old, inode)
            return
        parent.children[parts[-1]] = inode

    @staticmethod
    def _merge_dir(old: Inode, new: Inode) -> None:
        old.mode, old.uid, old.gid = new.mode, new.uid, new.gid
        old.mtime_ns, old.xattrs = new.mtime_ns, dict(new.xattrs)
        old.implicit = new.implicit
        if new.children:
            assert old.children is not None
            old.children.update(new.children)

    def link(self, path: str | bytes | tuple[bytes, ...],
             target: str | bytes | tuple[bytes, ...]) -> Inode:
        """Make ``path`` a hardlink to the inode now at ``target`` (tar semantics: the
        link binds to the target as it is at this moment). Returns that inode.

        Raises :class:`InvalidSourceError` if the target does not exist or is a directory.
        """
        parts = path if isinstance(path, tuple) else split_path(path)
        tparts = target if isinstance(target, tuple) else split_path(target)
        inode = self.get(tparts)
        if inode is None:
            raise InvalidSourceError(
                f"entry {display(parts)}: hardlink target {display(tparts)} does not exist")
        if inode.is_dir:
            raise InvalidSourceError(
                f"entry {display(parts)}: hardlink target {display(tparts)} is a directory")
        if not parts:
            raise InvalidSourceError("entry /: the layer root cannot be a hardlink")
        if parts == tparts:
            return inode
        self.put(parts, inode)
        return inode

    def remove(self, path: str | bytes | tuple[bytes, ...]) -> Inode | None:
        """Remove the entry at ``path`` (a directory with its subtree); returns it or None.
        Raises :class:`InvalidSourceError` for the root."""
        parts = path if isinstance(path, tuple) else split_path(path)
        if not parts:
            raise InvalidSourceError("entry /: the layer root cannot be removed")
        children = self._existing_children(parts)
        return None if children is None else children.pop(parts[-1], None)

    def walk(self) -> Iterator[tuple[tuple[bytes, ...], Inode]]:
        """Yield ``(parts, inode)`` for every name in the tree, the root first, then
        breadth-first with children in byte order (deterministic). A hardlinked inode is
        yielded once per name."""
        queue: list[tuple[tuple[bytes, ...], Inode]] = [((), self.root)]
        i = 0
        while i < len(queue):
            parts, node = queue[i]
            i += 1
            yield parts, node
            if node.children:
                for name in sorted(node.children):
                    queue.append(((*parts, name), node.children[name]))
