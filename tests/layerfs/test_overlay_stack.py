"""Three OCI layers with whiteouts and opaque directories, each written as an EROFS image
and stacked by overlayfs (lowerdir = top:mid:base), must show what docker-style layer
application shows: checked against a tree written out by hand and against the
``flatten=True`` conversion of the same layout."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerfs.mount import mounted_erofs, mounted_overlay
from layerfs.sources.oci import OciLayer, load_oci
from layerfs.writer import write_image
from tests.layerfs.test_oci import TAR, TGZ, TZST, Spec, make_layout, make_tar
from tests.layerfs.treecmp import Snapshot, assert_same, snapshot_dir, snapshot_tree

D = None  # a directory in a Spec

BASE: Spec = [
    ("etc", D), ("etc/passwd", "root:x:0:0"), ("etc/hosts", "127.0.0.1"),
    ("etc/conf.d", D), ("etc/conf.d/a.conf", "a"), ("etc/conf.d/b.conf", "b"),
    ("usr", D), ("usr/bin", D), ("usr/bin/tool", "v1"), ("usr/lib", D),
    ("usr/lib/libx.so", "libx"),
    ("var", D), ("var/cache", D), ("var/cache/big", "cache"),
    ("opt", D), ("opt/app", D), ("opt/app/old", "old"),
    ("home", D), ("home/user", D), ("home/user/file", "home"),
]
MID: Spec = [
    ("etc", D), ("etc/.wh.hosts", ""),                             # delete a file
    ("etc/conf.d", D), ("etc/conf.d/.wh..wh..opq", ""), ("etc/conf.d/c.conf", "c"),
    ("usr", D), ("usr/bin", D), ("usr/bin/tool", "v2"),            # replace a file
    ("var", D), ("var/.wh.cache", ""),                             # delete a directory
    ("newdir", D), ("newdir/.wh.ghost", ""), ("newdir/real", "real"),  # whiteout in a
    ("opt", D), ("opt/.wh.app", ""), ("opt/app", D),               # dir only this layer has
    ("opt/app/new", "new"),                                        # same-layer whiteout
    ("solo", D), ("solo/.wh.ghost", ""), ("solo/x", "x"),         # dir in this layer only
]
TOP: Spec = [
    ("etc", D), ("etc/hosts", "10.0.0.1"),                         # re-added
    ("etc/conf.d", D), ("etc/conf.d/.wh.c.conf", ""),
    ("usr", D), ("usr/lib", D), ("usr/lib/.wh.libx.so", ""),
    ("usr/bin", D), ("usr/bin/t3", "t3"), ("usr/bin/t4", "=>usr/bin/t3"),
    ("home", D), ("home/.wh..wh..opq", ""), ("home/other", D),
    ("newdir", D), ("newdir/.wh.real", ""),
    ("var", D), ("var/cache", D), ("var/cache/fresh", "fresh"),   # a deleted dir again
    ("bin", "->usr/bin"),
]

# What `docker run` would show: path -> file content, None for a directory, "->x" for a
# symlink.
EXPECTED: dict[str, str | None] = {
    "": D, "etc": D, "etc/passwd": "root:x:0:0", "etc/hosts": "10.0.0.1", "etc/conf.d": D,
    "usr": D, "usr/bin": D, "usr/bin/tool": "v2", "usr/bin/t3": "t3", "usr/bin/t4": "t3",
    "usr/lib": D, "var": D, "var/cache": D, "var/cache/fresh": "fresh",
    "opt": D, "opt/app": D, "opt/app/new": "new", "home": D, "home/other": D,
    "newdir": D, "bin": "->usr/bin", "solo": D, "solo/x": "x",
}


def _as_expected(root: Path) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out["" if rel == "." else rel] = None
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath,
                                                                                  d))]:
            p = os.path.join(dirpath, name)
            key = os.path.relpath(p, root)
            out[key] = "->" + os.readlink(p) if os.path.islink(p) else Path(p).read_text()
    return out


def _comparable(snap: Snapshot) -> Snapshot:
    # Directory link counts are each filesystem's own; the user.overlay.* xattrs that
    # per-layer images carry (for userxattr mounts) are ordinary xattrs to a trusted.*
    # overlay mount and show through it.
    return {
        rel: dataclasses.replace(
            e, nlink=0 if e.size is None else e.nlink,
            xattrs=tuple(x for x in e.xattrs if not x[0].startswith(b"user.overlay.")))
        for rel, e in snap.items()
    }


@contextlib.contextmanager
def _stacked(layout: Path, scratch: Path) -> Iterator[tuple[str, OciLayer]]:
    """The OCI layout's layers written as images, mounted and stacked with overlayfs:
    yields (the merged mountpoint, the flattened layer of the same layout)."""
    work = scratch / "work"
    work.mkdir()
    images = []
    for layer in load_oci(layout, "v1", workdir=work):
        image = scratch / f"layer{layer.index}.erofs"
        write_image(layer.tree, image)
        images.append(image)
    (flat,) = load_oci(layout, "v1", workdir=work, flatten=True)
    with contextlib.ExitStack() as stack:
        mounts = [stack.enter_context(mounted_erofs(img)) for img in images]
        yield stack.enter_context(mounted_overlay(list(reversed(mounts)))), flat


@pytest.mark.mount
def test_three_layer_overlay_equals_docker_application(tmp_path: Path,
                                                       scratch: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE, uid=100000), TAR), (make_tar(MID), TGZ),
                         (make_tar(TOP, mtime=1_800_000_000.5), TZST)])
    with _stacked(layout, scratch) as (merged, flat):
        assert _as_expected(Path(merged)) == EXPECTED
        actual = _comparable(snapshot_dir(merged))
    expected = _comparable(snapshot_tree(flat.tree))
    assert_same(actual, expected)
    # Spot checks that the comparison saw real metadata.
    assert expected[b"etc/passwd"].uid == 100000
    assert expected[b"etc/hosts"].mtime_ns == 1_800_000_000_500_000_000
    assert expected[b"usr/bin/t4"].links == (b"usr/bin/t3", b"usr/bin/t4")


def _tar_with_modes(entries: list[tuple[str, str | None, int, int, int]]) -> bytes:
    """(path, content, mode, uid, mtime) entries; content None is a directory, "->x" a
    symlink. No parent entries are added: what is not listed is implicit."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, content, mode, uid, mtime in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, uid, mtime
            data = b""
            if content is None:
                info.type = tarfile.DIRTYPE
            elif content.startswith("->"):
                info.type, info.linkname = tarfile.SYMTYPE, content[2:]
            else:
                data = content.encode()
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


LOWER_MODES = [
    (".", None, 0o750, 7, 1_500_000_000), ("tmp", None, 0o1777, 100000, 1_500_000_001),
    ("usr", None, 0o755, 0, 1_500_000_002), ("usr/lib", None, 0o700, 42, 1_500_000_003),
    ("lib", "->usr/lib", 0o777, 0, 1_500_000_004),
]
# Only files: tmp/, usr/, usr/lib/, lib/, fresh/, fresh/dir/ and / are all implicit.
UPPER_NO_PARENTS = [
    ("tmp/foo", "foo", 0o644, 0, 1_600_000_000), ("usr/lib/new.so", "so", 0o644, 0, 1_600_000_000),
    ("lib/new.so", "shadow", 0o644, 0, 1_600_000_000),
    ("fresh/dir/x", "x", 0o644, 0, 1_600_000_000),
]


@pytest.mark.mount
def test_layer_without_parent_entries_keeps_lower_directory_metadata(
        tmp_path: Path, scratch: Path) -> None:
    # Review finding: an upper tar with only tmp/foo over a lower /tmp 1777 gave 0755 root
    # 1970 in both the overlay stack and the flattened image.
    layout = tmp_path / "img"
    make_layout(layout, [(_tar_with_modes(LOWER_MODES), TAR),
                         (_tar_with_modes(UPPER_NO_PARENTS), TGZ)])
    with _stacked(layout, scratch) as (merged, flat):
        actual = _comparable(snapshot_dir(merged))
    expected = _comparable(snapshot_tree(flat.tree))
    assert_same(actual, expected)
    s = 1_000_000_000
    for snap in (actual, expected):
        assert (snap[b""].mode & 0o7777, snap[b""].uid) == (0o750, 7)
        tmp = snap[b"tmp"]
        assert (tmp.mode & 0o7777, tmp.uid, tmp.gid, tmp.mtime_ns) == (
            0o1777, 100000, 100000, 1_500_000_001 * s)
        lib = snap[b"usr/lib"]
        assert (lib.mode & 0o7777, lib.uid, lib.mtime_ns) == (0o700, 42, 1_500_000_003 * s)
        # Through a lower symlink: a real directory hides it (overlayfs/overlay2 agree).
        assert stat.S_ISDIR(snap[b"lib"].mode) and snap[b"lib"].target is None
        assert b"lib/new.so" in snap
        # Nothing below: 0755 0:0, the default mtime.
        for d in (b"fresh", b"fresh/dir"):
            assert (snap[d].mode & 0o7777, snap[d].uid, snap[d].mtime_ns) == (0o755, 0, 0)
