"""An overlayfs upper directory as a layer: the changes of a sandbox (DSec's ``pack_diff``).

A container sandbox's writable layer is overlayfs's upper directory: every file added or
changed is there (a changed lower file whole, copied up), every deletion a whiteout (a 0:0
character device), every directory that replaced a lower one opaque
(``trusted.overlay.opaque=y``). Read as a layer and stacked over the sandbox's layers, it
gives the sandbox's filesystem back (kernel ``Documentation/filesystems/overlayfs.rst``).

:func:`load_upper` scans the directory like any directory source
(:mod:`layerfs.sources.directory`: ``lstat`` only, no symlink followed, names kept byte for
byte, hardlinks kept) and then:

- **ids**: the upper's owners are host ids of the sandbox's user namespace; each becomes
  the sandbox's own (``host - id_base`` for ids in ``[id_base, id_base + id_count)``; the
  whiteouts overlayfs makes are owned by 0:0 and stay so; any other id is refused);
- **overlay xattrs**: overlayfs's bookkeeping (``origin``, ``impure``, ``uuid``, ``nlink``,
  ``upper``, ``protattr``, in the ``trusted.`` or ``user.`` namespace) is dropped; an opaque
  directory gets both ``trusted.overlay.opaque=y`` and ``user.overlay.opaque=y`` (what
  every layer of ours carries, :mod:`layerfs.sources.whiteout`); a directory holding a
  whiteout gets the empty origin xattrs (:func:`~layerfs.sources.whiteout.mark_whiteout_dirs`).
  A ``redirect`` (a renamed lower directory) or ``metacopy`` (metadata-only copy-up) xattr
  is refused: a layer of its own cannot carry what it points at (neither is made with the
  overlay options edged mounts);
- **file capabilities** (``security.capability``) are dropped: one set inside a user
  namespace names that namespace's root by its host id, meaningless in another sandbox;
- **sockets** are dropped (a bound socket is a live object, not content);
- **excludes** drop whole subtrees by path pattern (build residue: ``__pycache__``,
  ``/tmp``, ``/root/.cache``...), whiteouts under them included, so the lower layers'
  entries show through there again.

What is dropped is counted in the :class:`UpperReport`. The result is a
:class:`~layerfs.tree.Tree` for :func:`layerfs.build.build_tree`: deterministic like any
layer (same upper, same bytes), and the caller must keep the upper unchanged until the
image is written (the writer reads file data then, and refuses a file that changed).
"""

from __future__ import annotations

import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from layerfs.errors import InvalidSourceError
from layerfs.sources.directory import load_directory
from layerfs.sources.whiteout import OPAQUE_XATTRS, mark_whiteout_dirs
from layerfs.tree import Inode, Tree, display

__all__ = ["UpperReport", "compile_excludes", "load_upper"]

_OVERLAY_PREFIXES = (b"trusted.overlay.", b"user.overlay.")
_REFUSED = (b"redirect", b"metacopy")
MAX_EXCLUDES = 256


@dataclass
class UpperReport:
    """What :func:`load_upper` found and left out. Counts of inodes."""

    inodes: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    excluded: int = 0
    dropped_sockets: int = 0
    dropped_capabilities: int = 0
    excluded_paths: list[str] = field(default_factory=list)


def compile_excludes(patterns: Iterable[str]) -> re.Pattern[bytes] | None:
    """One regex for path patterns: a pattern with a ``/`` is anchored at the layer root
    (``/tmp``, ``/root/.cache``, ``/work/**/build``); one without matches a name at any
    depth (``__pycache__``, ``*.pyc``). ``*`` and ``?`` stay within a name, ``**`` crosses
    ``/``. Raises :class:`InvalidSourceError` for an empty pattern, a NUL, ``..``, or more
    than :data:`MAX_EXCLUDES` patterns."""
    parts = []
    pats = list(patterns)
    if len(pats) > MAX_EXCLUDES:
        raise InvalidSourceError(f"exclude: {MAX_EXCLUDES} patterns at most")
    for p in pats:
        if not p or "\0" in p or ".." in p.split("/") or len(p) > 4096:
            raise InvalidSourceError(f"exclude {p[:80]!r}: empty, over-long, NUL or '..'")
        anchored = "/" in p.rstrip("/")
        body = p.strip("/")
        rx = ""
        i = 0
        while i < len(body):
            if body.startswith("**", i):
                rx += ".*"
                i += 2
            elif body[i] == "*":
                rx += "[^/]*"
                i += 1
            elif body[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(body[i])
                i += 1
        parts.append(("" if anchored else "(?:.*/)?") + rx)
    if not parts:
        return None
    return re.compile(("(?:" + "|".join(parts) + ")").encode("utf-8", "surrogateescape"),
                      re.DOTALL)


def _map_id(v: int, base: int, count: int, what: str, where: str) -> int:
    if base <= v < base + count:
        return v - base
    if v == 0:
        return 0
    raise InvalidSourceError(f"upper entry {where}: {what} {v} is outside the sandbox's ids "
                             f"[{base}, {base + count})")


def load_upper(path: str, *, id_base: int = 0, id_count: int = 1 << 32,
               exclude: Iterable[str] = ()) -> tuple[Tree, UpperReport]:
    """The upper directory ``path`` as a layer's tree (rules: module docstring).

    Raises :class:`InvalidSourceError` naming the entry (an id outside the range, a
    redirect or metacopy xattr, a bad exclude pattern) and whatever the directory source
    raises (an entry that changed while it was scanned, a path over ``PATH_MAX``)."""
    rx = compile_excludes(exclude)
    tree = load_directory(path)
    rep = UpperReport()
    stack: list[tuple[tuple[bytes, ...], Inode]] = [((), tree.root)]
    seen: set[int] = set()  # a hardlinked inode is one object under several names
    while stack:
        parts, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        where = display(parts) if parts else "/"
        rep.inodes += 1
        node.uid = _map_id(node.uid, id_base, id_count, "uid", where)
        node.gid = _map_id(node.gid, id_base, id_count, "gid", where)
        opaque = False
        for key in list(node.xattrs):
            if key.startswith(_OVERLAY_PREFIXES):
                name = key.split(b".", 2)[2]
                if name in _REFUSED:
                    raise InvalidSourceError(
                        f"upper entry {where}: overlay {name.decode()} xattr (a renamed "
                        f"lower directory or a metadata-only copy-up) cannot be a layer")
                opaque = opaque or (name == b"opaque" and node.xattrs[key] == b"y")
                del node.xattrs[key]
            elif key == b"security.capability":
                del node.xattrs[key]
                rep.dropped_capabilities += 1
        if node.is_whiteout:  # (overlayfs links every whiteout to one inode: counted by name)
            node.uid = node.gid = 0
        if not node.is_dir:
            continue
        if opaque:
            for key in OPAQUE_XATTRS:
                node.xattrs[key] = b"y"
            rep.opaque_dirs += 1
        assert node.children is not None
        for name in sorted(node.children):
            child = node.children[name]
            cparts = (*parts, name)
            if child.is_whiteout:
                rep.whiteouts += 1
            if stat.S_ISSOCK(child.mode):
                del node.children[name]
                rep.dropped_sockets += 1
                continue
            if rx is not None and rx.fullmatch(b"/".join(cparts)):
                del node.children[name]
                rep.excluded += _count(child)
                if len(rep.excluded_paths) < 100:
                    rep.excluded_paths.append(display(cparts))
                continue
            stack.append((cparts, child))
    mark_whiteout_dirs(tree)
    return tree, rep


def _count(node: Inode) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        if x.children:
            stack.extend(x.children.values())
    return n
