"""layerfs.sources.whiteout: OCI markers per layer (overlayfs form) and when flattening."""

from __future__ import annotations

import stat
from typing import Any

import pytest

from layerfs.errors import InvalidSourceError
from layerfs.sources.whiteout import apply_layer, convert_layer, flatten
from layerfs.tree import Inode, Tree, new_dir

ORIGIN = {b"trusted.overlay.origin": b"", b"user.overlay.origin": b""}
OPAQUE = {b"trusted.overlay.opaque": b"y", b"user.overlay.opaque": b"y"}


def f(data: str = "", **kw: Any) -> Inode:
    """A regular file inode (no Data: these tests never read bytes)."""
    return Inode(mode=stat.S_IFREG | 0o644, size=len(data), **kw)


def marker(**kw: Any) -> Inode:
    return Inode(mode=stat.S_IFREG | 0o600, **kw)


def build(entries: dict[str, Inode]) -> Tree:
    tree = Tree()
    for path, inode in entries.items():
        tree.put(path, inode)
    return tree


def snapshot(tree: Tree) -> dict[str, tuple[Any, ...]]:
    """Everything observable about a tree, keyed by path (for equality checks)."""
    return {
        "/" + b"/".join(parts).decode(): (
            stat.S_IFMT(node.mode), node.mode & 0o7777, node.uid, node.gid, node.mtime_ns,
            node.size, node.rdev_major, node.rdev_minor, node.target,
            tuple(sorted(node.xattrs.items())),
        )
        for parts, node in tree.walk()
    }


def names(tree: Tree) -> set[str]:
    return {"/" + b"/".join(p).decode() for p, _ in tree.walk()}


# ----------------------------------------------------------------- per layer


def test_whiteout_becomes_char_device_with_origin_on_its_directory() -> None:
    tree = build({"d/.wh.gone": marker(uid=5, gid=6, mtime_ns=77), "d/keep": f()})
    convert_layer(tree)
    wh = tree.get("d/gone")
    assert wh is not None and wh.is_whiteout and wh.mode == stat.S_IFCHR
    assert (wh.uid, wh.gid, wh.mtime_ns) == (5, 6, 77)
    assert tree.get("d/.wh.gone") is None
    assert tree.get("d").xattrs == ORIGIN  # type: ignore[union-attr]
    assert names(tree) == {"/", "/d", "/d/gone", "/d/keep"}


def test_opaque_marker_sets_both_xattrs() -> None:
    tree = build({"d/.wh..wh..opq": marker(), "d/new": f(), ".wh..wh..opq": marker()})
    convert_layer(tree)
    assert tree.get("d").xattrs == OPAQUE  # type: ignore[union-attr]
    assert tree.root.xattrs == OPAQUE
    assert names(tree) == {"/", "/d", "/d/new"}


def test_whiteout_and_opaque_in_one_directory() -> None:
    tree = build({"d/.wh..wh..opq": marker(), "d/.wh.x": marker()})
    convert_layer(tree)
    assert tree.get("d").xattrs == {**OPAQUE, **ORIGIN}  # type: ignore[union-attr]


def test_whiteout_for_a_file_of_the_same_layer_is_dropped() -> None:
    tree = build({"d/x": f("new"), "d/.wh.x": marker()})
    convert_layer(tree)
    x = tree.get("d/x")
    assert x is not None and stat.S_ISREG(x.mode) and x.size == 3
    assert tree.get("d").xattrs == {}  # type: ignore[union-attr]
    assert names(tree) == {"/", "/d", "/d/x"}


def test_whiteout_for_a_directory_of_the_same_layer_makes_it_opaque() -> None:
    tree = build({".wh.d": marker(), "d/new": f()})
    convert_layer(tree)
    assert tree.get("d").xattrs == OPAQUE  # type: ignore[union-attr]
    assert tree.root.xattrs == {}
    assert names(tree) == {"/", "/d", "/d/new"}


def test_literal_whiteout_device_is_kept_and_marks_its_directory() -> None:
    tree = build({"d/w": Inode(mode=stat.S_IFCHR)})
    convert_layer(tree)
    assert tree.get("d/w").is_whiteout  # type: ignore[union-attr]
    assert tree.get("d").xattrs == ORIGIN  # type: ignore[union-attr]


def test_aufs_metadata_dropped_with_its_subtree() -> None:
    tree = build({".wh..wh.plnk/123.456": f("x"), ".wh..wh.aufs": f(), "a": f()})
    convert_layer(tree)
    assert names(tree) == {"/", "/a"}


@pytest.mark.parametrize(("entries", "match"), [
    ({"d/.wh.x/": new_dir()}, "not a directory"),
    ({"d/.wh.x": f("data")}, "not a file of 4 bytes"),
    ({"d/.wh.x": Inode(mode=stat.S_IFLNK | 0o777, target=b"t", size=1)}, "not a symlink"),
    ({"d/.wh.x": Inode(mode=stat.S_IFIFO)}, "not a special file"),
    ({"d/.wh..wh..opq/": new_dir()}, "not a directory"),
    ({"d/.wh.": marker()}, "names no entry"),
    ({"d/.wh..": marker()}, "names no entry"),
    ({"d/.wh...": marker()}, "names no entry"),
])
def test_odd_markers_rejected_and_tree_unchanged(entries: dict[str, Inode],
                                                  match: str) -> None:
    tree = build({"d/.wh.ok": marker(), **entries})
    before = snapshot(tree)
    with pytest.raises(InvalidSourceError, match=rf"layer L1: entry /d/\.wh\..*{match}"):
        convert_layer(tree, label="L1")
    assert snapshot(tree) == before
    lower = build({"d/ok": f()})
    lower_before = snapshot(lower)
    with pytest.raises(InvalidSourceError, match=match):
        apply_layer(lower, tree, label="L1")
    assert snapshot(lower) == lower_before and snapshot(tree) == before


def test_hardlinked_markers_are_fine() -> None:
    m = marker()
    tree = build({"a/.wh.x": m, "b/.wh.y": m})
    convert_layer(tree)
    assert tree.get("a/x").is_whiteout and tree.get("b/y").is_whiteout  # type: ignore[union-attr]


# ----------------------------------------------------------------- flattened


def test_flatten_deletes_clears_and_merges() -> None:
    base = build({
        "etc/": new_dir(mode=0o755, mtime_ns=1),
        "etc/passwd": f("root"),
        "etc/old": f("o"),
        "etc/sub/deep": f("d"),
        "opt/a": f("a"),
        "opt/b/c": f("c"),
        "var/x": f("x"),
        "link": Inode(mode=stat.S_IFLNK | 0o777, target=b"etc", size=3),
        "swap": f("file becomes dir"),
    })
    mid = build({
        "etc/": new_dir(mode=0o700, uid=1, mtime_ns=2),
        "etc/.wh.old": marker(),
        "etc/.wh.sub": marker(),
        "etc/new": f("n"),
        "opt/.wh..wh..opq": marker(),
        "opt/mine": f("m"),
        "var/": new_dir(),
        "var/x": f("replaced"),
        "var/.wh.x": marker(),            # same layer: the layer's var/x stays
        "link/.wh.passwd": marker(),      # lower link is a symlink: nothing to delete
        "swap/inner": f("i"),
        ".wh.missing": marker(),
    })
    top = build({
        ".wh.var": marker(),
        "var/fresh": f("f"),              # whiteout + dir in one layer: opaque
        "etc/": new_dir(mode=0o700, uid=1, mtime_ns=3),
        "etc/passwd": Inode(mode=stat.S_IFCHR),  # a literal whiteout device
    })
    merged = flatten([base, mid, top])
    assert names(merged) == {
        "/", "/etc", "/etc/new", "/link", "/opt", "/opt/mine", "/swap", "/swap/inner",
        "/var", "/var/fresh",
    }
    etc = merged.get("etc")
    assert etc is not None and etc.mode & 0o7777 == 0o700 and etc.uid == 1
    for _, node in merged.walk():
        assert not node.is_whiteout
        assert not any(k.startswith((b"trusted.overlay.", b"user.overlay."))
                       for k in node.xattrs)


def test_flatten_dir_merge_keeps_lower_children_and_takes_top_metadata() -> None:
    lower = build({"d/": new_dir(mode=0o750, uid=3), "d/a": f(), "d/e/x": f()})
    upper = build({"d/": new_dir(mode=0o711, uid=4, mtime_ns=9), "d/b": f(),
                   "d/e/y": f()})
    apply_layer(lower, upper)
    assert names(lower) == {"/", "/d", "/d/a", "/d/b", "/d/e", "/d/e/x", "/d/e/y"}
    d = lower.get("d")
    assert d is not None and (d.mode & 0o7777, d.uid, d.mtime_ns) == (0o711, 4, 9)


def test_flatten_file_replaces_dir_and_keeps_hardlinks() -> None:
    shared = f("s")
    lower = build({"d/a": f()})
    upper = build({"d": f("file"), "h1": shared, "h2": shared})
    apply_layer(lower, upper)
    assert stat.S_ISREG(lower.get("d").mode)  # type: ignore[union-attr]
    assert lower.get("h1") is lower.get("h2")


def test_flatten_of_one_layer_equals_the_layer_without_markers() -> None:
    layer = build({"a/b": f("x"), "a/.wh.c": marker(), "a/.wh..wh..opq": marker()})
    assert names(flatten([layer])) == {"/", "/a", "/a/b"}


# -- implicit parent directories; deep paths ----------------------------------------------

def test_flatten_implicit_dir_keeps_lower_metadata() -> None:
    lower = Tree()
    lower.put("", new_dir(0o750, uid=7, mtime_ns=3))
    lower.put("tmp", new_dir(0o1777, uid=5, gid=6, mtime_ns=9))
    lower.get("tmp").xattrs[b"user.k"] = b"v"  # type: ignore[union-attr]
    lower.put("lib", Inode(mode=stat.S_IFLNK | 0o777, target=b"usr/lib", size=7))
    upper = Tree()  # a tar with only files: / and tmp/ and lib/ are implicit
    upper.put("tmp/foo", f("x"))
    upper.put("lib/new.so", f("y"))
    upper.put("fresh/x", f("z"))
    merged = flatten([lower, upper])
    tmp = merged.get("tmp")
    assert tmp is not None
    assert (tmp.mode, tmp.uid, tmp.gid, tmp.mtime_ns, tmp.xattrs) == (
        stat.S_IFDIR | 0o1777, 5, 6, 9, {b"user.k": b"v"})
    assert set(tmp.children or {}) == {b"foo"}
    assert (merged.root.mode, merged.root.uid) == (stat.S_IFDIR | 0o750, 7)
    lib = merged.get("lib")  # a lower symlink is not followed: a real directory hides it
    assert lib is not None and lib.is_dir and set(lib.children or {}) == {b"new.so"}
    fresh = merged.get("fresh")
    assert fresh is not None and (fresh.mode, fresh.uid, fresh.mtime_ns) == (
        stat.S_IFDIR | 0o755, 0, 0)


def test_explicit_dir_still_overrides_in_flatten() -> None:
    lower = Tree()
    lower.put("tmp", new_dir(0o1777, uid=5))
    upper = Tree()
    upper.put("tmp/foo", f("x"))
    upper.put("tmp", new_dir(0o700, uid=1))  # described after its child: explicit now
    tmp = flatten([lower, upper]).get("tmp")
    assert tmp is not None and (tmp.mode, tmp.uid) == (stat.S_IFDIR | 0o700, 1)


def test_flatten_of_a_3000_deep_path() -> None:
    # Review finding: RecursionError in _merge_dir.
    deep = "/".join(["d"] * 3000)
    lower, upper = Tree(), Tree()
    lower.put(deep + "/a", f("a"))
    upper.put(deep + "/b", f("b"))
    merged = flatten([lower, upper])
    node = merged.get(deep)
    assert node is not None and set(node.children or {}) == {b"a", b"b"}
