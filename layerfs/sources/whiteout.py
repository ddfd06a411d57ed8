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
  deletes the lower entry and disappears, so both conversions show the same tree.

Every error is an :class:`~layerfs.errors.InvalidSourceError` naming the layer and the
entry; the tree is checked completely before it is changed, so a refused layer leaves
its tree (and the lower tree) as they were.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from layerfs.errors import InvalidSourceError
from layerfs.tree import Inode, Tree, display

WHITEOUT_PREFIX = b".wh."
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
    lower.mode, lower.uid, lower.gid = upper.mode, upper.uid, upper.gid
    lower.mtime_ns, lower.xattrs = upper.mtime_ns, dict(upper.xattrs)
    assert lower.children is not None and upper.children is not None
    for name, child in upper.children.items():
        old = lower.children.get(name)
        if old is not None and old.is_dir and child.is_dir:
            _merge_dir(old, child)
        else:
            lower.children[name] = child


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
