"""Property test: random trees (bounded) mount back equal and pass fsck.erofs."""

from __future__ import annotations

import pathlib
import stat
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerfs.mount import mounted_erofs
from layerfs.tree import Data, Inode, Tree, new_dir
from layerfs.writer import write_image
from tests.layerfs.conftest import fsck_erofs
from tests.layerfs.treecmp import assert_same, snapshot_dir, snapshot_tree

names = st.binary(min_size=1, max_size=40).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))
ids = st.sampled_from([0, 1, 1000, 65535, 65536, 100000, 2**32 - 2])
mtimes = st.one_of(st.just(1_700_000_000 * 10**9),
                   st.integers(min_value=-(2**40) * 10**9, max_value=2**40 * 10**9))
perms = st.integers(min_value=0, max_value=0o7777)
xattrs = st.dictionaries(
    st.tuples(st.sampled_from([b"user.", b"trusted.", b"security."]),
              st.binary(min_size=1, max_size=20).filter(lambda b: b"\0" not in b))
    .map(lambda t: t[0] + t[1]),
    st.binary(max_size=300), max_size=4)
meta = st.fixed_dictionaries({"uid": ids, "gid": ids, "mtime_ns": mtimes, "xattrs": xattrs})

leaf = st.one_of(
    st.tuples(st.just("file"), st.binary(max_size=9000), perms, meta),
    st.tuples(st.just("link"), st.binary(min_size=1, max_size=300).filter(
        lambda b: b"\0" not in b), st.just(0o777), meta),
    st.tuples(st.just("dev"), st.tuples(st.sampled_from([stat.S_IFCHR, stat.S_IFBLK]),
                                        st.integers(0, 4095), st.integers(0, 0xFFFFF)),
              perms, meta),
    st.tuples(st.just("fifo"), st.none(), perms, meta),
)
trees = st.recursive(
    leaf,
    lambda children: st.tuples(st.just("dir"), st.dictionaries(names, children, max_size=6),
                               perms, meta),
    max_leaves=25)


def build(spec: tuple, d: pathlib.Path, counter: list[int]) -> Inode:  # type: ignore[type-arg]
    kind, payload, mode, m = spec
    if kind not in ("dir", "file"):
        # Linux allows user.* xattrs only on regular files and directories (the
        # kernel lists but will not read others: fs/xattr.c xattr_permission()).
        m = dict(m, xattrs={k: v for k, v in m["xattrs"].items()
                            if not k.startswith(b"user.")})
    if kind == "dir":
        node = new_dir(mode, m["uid"], m["gid"], m["mtime_ns"])
        node.xattrs = dict(m["xattrs"])
        assert node.children is not None
        for name, child in payload.items():
            node.children[name] = build(child, d, counter)
        return node
    if kind == "file":
        counter[0] += 1
        p = d / f"f{counter[0]}"
        p.write_bytes(payload)
        return Inode(mode=stat.S_IFREG | mode, size=len(payload), data=Data(str(p)), **m)
    if kind == "link":
        return Inode(mode=stat.S_IFLNK | 0o777, target=payload, size=len(payload), **m)
    if kind == "dev":
        fmt, major, minor = payload
        return Inode(mode=fmt | mode, rdev_major=major, rdev_minor=minor, **m)
    return Inode(mode=stat.S_IFIFO | mode, **m)


@pytest.mark.mount
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=trees, root_meta=meta, hardlinks=st.integers(0, 3))
def test_random_trees_roundtrip(spec: tuple, root_meta: dict, hardlinks: int) -> None:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory(prefix="layerfs-prop-", dir="/var/tmp") as tmp:
        d = pathlib.Path(tmp)
        tree = Tree(new_dir(0o755, root_meta["uid"], root_meta["gid"], root_meta["mtime_ns"]))
        tree.root.xattrs = dict(root_meta["xattrs"])
        assert tree.root.children is not None
        tree.root.children[b"t"] = build(spec, d, [0])
        # hardlinks: extra names at the root for the first few non-directories
        others = [n for _, n in tree.walk() if not n.is_dir][:hardlinks]
        for i, node in enumerate(others):
            tree.root.children[b"hl%d" % i] = node
        img = d / "img.erofs"
        write_image(tree, img)
        fsck_erofs(img)
        with mounted_erofs(img) as mp:
            assert_same(snapshot_dir(mp), snapshot_tree(tree))
