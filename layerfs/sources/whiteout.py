"""OCI whiteouts: per-layer conversion to overlayfs form, or application when flattening.

An OCI layer deletes things from the layers below it with marker files (OCI image-spec
``layer.md``, "Whiteouts"): ``DIR/.wh.NAME`` removes ``DIR/NAME``; ``DIR/.wh..wh..opq``
removes every lower entry of ``DIR`` (an opaque directory). Markers apply only to lower
layers, never to entries of their own layer.

Per-layer conversion (:func:`convert_layer`, one EROFS image per OCI layer, stacked by
overlayfs) turns them into what overlayfs reads (kernel
``Documentation/filesystems/overlayfs.rst``; ``shared/reference/erofs-format.md`` §8):

- ``.wh.NAME`` → a character device 0:0 named ``NAME`` (mode ``S_IFCHR`` with no
  permission bits, owner and mtime of the marker), and the directory holding it gets empty
  ``trusted.overlay.origin`` and ``user.overlay.origin`` xattrs: without them a whiteout
  in a directory that exists only in its own layer shows up as a broken entry;
- ``.wh..wh..opq`` → ``trusted.overlay.opaque=y`` and ``user.overlay.opaque=y`` on its
  directory (``user.`` for unprivileged ``userxattr`` mounts).

Flattened conversion (:func:`apply_layer`, :func:`flatten`) applies each layer to the
merged tree of the layers below it, as ``docker``/``containerd`` layer application does:
first the layer's whiteouts delete lower entries and its opaque markers empty lower
directories, then the layer's entries are merged in (a directory over a directory updates
its metadata and merges children, anything else replaces). No whiteout inode and no
overlay xattr remains. A merged directory takes the metadata of the top layer that has
it, which is what overlayfs shows too.

Implicit directories (:attr:`Inode.implicit <layerfs.tree.Inode>`: a parent that a layer's
tar has no entry for, e.g. ``tmp/`` of a layer holding only ``tmp/foo``) never override
the metadata of the same directory below, as in docker: flattening keeps the lower
directory's mode, owner, mtime and xattrs, and per-layer conversion (:class:`LowerDirs`)
copies them into the implicit directory so the overlay view shows them. With nothing below
it stays ``0755 0:0`` with the default mtime. A path through a lower symlink (lower
``lib -> usr/lib``, upper ``lib/new.so``) is not followed: the upper ``lib`` is a real
directory that hides the symlink, which is what overlayfs and docker's overlay2 show, and
flattening does the same.

Odd shapes, and the rule for each (tests hold every one):

- a marker must be an empty regular file (hardlinks among markers are fine); a marker
  that is a directory, symlink, device, FIFO or has data is refused;
- ``.wh.`` (empty name), ``.wh..`` and ``.wh...`` (``.`` and ``..``) are refused;
- ``.wh..wh.*`` names other than ``.wh..wh..opq`` are AUFS bookkeeping (``.wh..wh.plnk``,
  ``.wh..wh.aufs``, ``.wh..wh.orph``): dropped with their subtree, as docker does;
- ``.wh.NAME`` when the same layer also has ``NAME``: the whiteout still applies to the
  lower layers only. If ``NAME`` is not a directory, it already hides the lower entry and
  the marker is dropped; if ``NAME`` is a directory, the lower one's contents must not
  show through, so the directory becomes opaque;
- a character device 0:0 present in the layer as such is already an overlayfs whiteout:
  kept per layer (its directory gets the origin xattrs), and in a flattened conversion it
  deletes the lower entry and disappears (with the origin xattrs), so both conversions
  show the same tree. The tar source treats it the same way in any layer, OCI or not
  (:func:`mark_whiteout_dirs`; :mod:`layerfs.sources.tar` says why).

Every error is an :class:`~layerfs.errors.InvalidSourceError` naming the layer and the
entry; the tree is checked completely before it is changed, so a refused layer leaves
its tree (and the lower tree) as they were.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from layerfs.errors import InvalidSourceError
from layerfs.tree import WHITEOUT_PREFIX, Inode, Tree, display, new_dir

OPAQUE_MARKER = b".wh..wh..opq"
AUFS_META_PREFIX = b".wh..wh."
OPAQUE_XATTRS = (b"trusted.overlay.opaque", b"user.overlay.opaque")
ORIGIN_XATTRS = (b"trusted.overlay.origin", b"user.overlay.origin")


@dataclass
class _DirMarks:
    parts: tuple[bytes, ...]
    node: Inode
    markers: list[bytes] = field(default_factory=list)    # marker names to remove
    whiteouts: list[tuple[bytes, Inode]] = field(default_factory=list)  # (NAME, marker)
    devices: list[bytes] = field(default_factory=list)    # 0:0 char devices already there
    opaque: bool = False


def _kind(inode: Inode) -> str:
    if inode.is_dir:
        return "a directory"
    if stat.S_ISLNK(inode.mode):
        return "a symlink"
    if stat.S_ISREG(inode.mode):
        return f"a file of {inode.size} bytes"
    return "a special file"


def _scan(tree: Tree, label: str) -> list[_DirMarks]:
    """Find and validate every marker without changing anything."""
    found: list[_DirMarks] = []
    stack: list[tuple[tuple[bytes, ...], Inode]] = [((), tree.root)]
    while stack:
        parts, node = stack.pop()
        assert node.children is not None
        marks = _DirMarks(parts, node)
        for name in sorted(node.children):
            child = node.children[name]
            path = display((*parts, name))
            if name.startswith(AUFS_META_PREFIX) and name != OPAQUE_MARKER:
                marks.markers.append(name)
                continue
            if name.startswith(WHITEOUT_PREFIX):
                target = name[len(WHITEOUT_PREFIX):]
                if target in (b"", b".", b".."):
                    raise InvalidSourceError(
                        f"layer {label}: entry {path}: whiteout of {target!r} names no entry")
                if not stat.S_ISREG(child.mode) or child.size != 0:
                    raise InvalidSourceError(
                        f"layer {label}: entry {path}: a whiteout marker must be an empty "
                        f"regular file, not {_kind(child)}")
                marks.markers.append(name)
                if name == OPAQUE_MARKER:
                    marks.opaque = True
                else:
                    marks.whiteouts.append((target, child))
                continue
            if child.is_whiteout:
                marks.devices.append(name)
            elif child.is_dir:
                stack.append(((*parts, name), child))
        if marks.markers or marks.devices:
            found.append(marks)
    return found


def mark_whiteout_dirs(tree: Tree) -> None:
    """Give every directory of ``tree`` that holds an overlayfs whiteout (a 0:0
    character device) the empty ``trusted.overlay.origin`` and ``user.overlay.origin``
    xattrs, in place, as :func:`convert_layer` does for OCI whiteouts: overlayfs hides
    the lower entry either way, but in a directory that only this layer has, an
    unmarked whiteout shows up as a broken entry (``c?????????``; checked on Linux 6.18).
    """
    stack = [tree.root]
    while stack:
        node = stack.pop()
        assert node.children is not None
        marked = False
        for child in node.children.values():
            if child.is_dir:
                stack.append(child)
            elif not marked and child.is_whiteout:
                for key in ORIGIN_XATTRS:
                    node.xattrs[key] = b""
                marked = True


def convert_layer(tree: Tree, *, label: str = "layer") -> Tree:
    """Turn the OCI markers of one layer's ``tree`` into overlayfs whiteouts and opaque
    directories, in place (rules: module docstring). Returns ``tree``.

    Raises :class:`~layerfs.errors.InvalidSourceError` naming ``label`` and the entry for
    a marker of an odd shape; ``tree`` is then unchanged.
    """
    for marks in _scan(tree, label):
        children = marks.node.children
        assert children is not None
        holds_whiteout = bool(marks.devices)
        opaque = marks.opaque
        for name in marks.markers:
            del children[name]
        for target, marker in marks.whiteouts:
            existing = children.get(target)
            if existing is None:
                children[target] = Inode(mode=stat.S_IFCHR, uid=marker.uid, gid=marker.gid,
                                         mtime_ns=marker.mtime_ns)
                holds_whiteout = True
            elif existing.is_dir:
                for key in OPAQUE_XATTRS:
                    existing.xattrs[key] = b"y"
            elif existing.is_whiteout:
                holds_whiteout = True
        if holds_whiteout:
            for key in ORIGIN_XATTRS:
                marks.node.xattrs[key] = b""
        if opaque:
            for key in OPAQUE_XATTRS:
                marks.node.xattrs[key] = b"y"
    return tree


def _merge_dir(lower: Inode, upper: Inode) -> None:
    # Iterative: a layer may nest directories thousands deep.
    stack = [(lower, upper)]
    while stack:
        lo, up = stack.pop()
        if not up.implicit:
            lo.mode, lo.uid, lo.gid = up.mode, up.uid, up.gid
            lo.mtime_ns, lo.xattrs = up.mtime_ns, dict(up.xattrs)
            lo.implicit = False
        assert lo.children is not None and up.children is not None
        for name, child in up.children.items():
            old = lo.children.get(name)
            if old is not None and old.is_dir and child.is_dir:
                stack.append((old, child))
            else:
                lo.children[name] = child


def _is_overlay_xattr(name: bytes) -> bool:
    return name.startswith((b"trusted.overlay.", b"user.overlay."))


def _copy_meta(dst: Inode, src: Inode) -> None:
    """``src``'s mode, owner, mtime and xattrs onto ``dst``; overlay xattrs stay as they
    are on ``dst`` (they are about ``dst``'s own layer: opaque, origin)."""
    dst.mode, dst.uid, dst.gid, dst.mtime_ns = src.mode, src.uid, src.gid, src.mtime_ns
    keep = {k: v for k, v in dst.xattrs.items() if _is_overlay_xattr(k)}
    dst.xattrs = {k: v for k, v in src.xattrs.items() if not _is_overlay_xattr(k)}
    dst.xattrs.update(keep)


class LowerDirs:
    """Directory metadata of the layers converted so far, merged as overlayfs shows it,
    for per-layer conversion: :meth:`apply` gives each implicit directory of the next
    layer (:attr:`Inode.implicit <layerfs.tree.Inode>`) the metadata of the same
    directory below, so the overlay view keeps the lower mode, owner, mtime and xattrs,
    as docker-style layer application does. Only directories are kept (no file data)."""

    def __init__(self) -> None:
        self.root = new_dir()
        self._empty = True

    def apply(self, tree: Tree) -> None:
        """Fill ``tree``'s implicit directories from the layers below, then record
        ``tree`` (already in overlay form, :func:`convert_layer`) as the top layer."""
        stack: list[tuple[Inode, Inode, bool]] = [(tree.root, self.root, self._empty)]
        self._empty = False
        while stack:
            up, sh, fresh = stack.pop()
            if up.implicit and not fresh:
                _copy_meta(up, sh)
            else:
                _copy_meta(sh, up)
            assert up.children is not None and sh.children is not None
            if up.xattrs.get(OPAQUE_XATTRS[0]) == b"y":
                sh.children.clear()
            for name, child in up.children.items():
                low = sh.children.get(name)
                if child.is_dir:
                    new = low is None or not low.is_dir
                    if new:
                        low = sh.children[name] = new_dir()
                    assert low is not None
                    stack.append((child, low, new))
                else:  # a file, link, device or whiteout hides whatever was below
                    sh.children.pop(name, None)


def apply_layer(lower: Tree, layer: Tree, *, label: str = "layer") -> None:
    """Apply ``layer`` (a tree with OCI markers) on top of ``lower`` the way docker-style
    layer application does (module docstring). ``lower`` is changed in place; ``layer``
    is consumed (its inodes move into ``lower``).

    Raises :class:`~layerfs.errors.InvalidSourceError` naming ``label`` and the entry for
    a marker of an odd shape; both trees are then unchanged.
    """
    found = _scan(layer, label)
    for marks in found:
        children = marks.node.children
        assert children is not None
        for name in marks.markers + marks.devices:
            del children[name]
        if marks.devices:  # marked by the tar source (mark_whiteout_dirs); none remain
            for key in ORIGIN_XATTRS:
                marks.node.xattrs.pop(key, None)
        base = lower.get(marks.parts)
        if base is None or not base.is_dir:
            continue
        assert base.children is not None
        if marks.opaque:
            base.children.clear()
        for target in [t for t, _ in marks.whiteouts] + marks.devices:
            base.children.pop(target, None)
    _merge_dir(lower.root, layer.root)


def flatten(layers: Iterable[Tree], *, labels: Iterable[str] | None = None) -> Tree:
    """Merge ``layers`` (bottom first, each with OCI markers) into one new tree with no
    whiteouts (see :func:`apply_layer`). The input trees are consumed."""
    merged = Tree()
    names = iter(labels) if labels is not None else None
    for i, layer in enumerate(layers):
        label = next(names, f"#{i}") if names is not None else f"#{i}"
        apply_layer(merged, layer, label=label)
    return merged
