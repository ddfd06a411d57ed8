"""The EROFS writer: every feature round-trips through a kernel mount and fsck.erofs;
output is deterministic; bad input is refused with the entry named."""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import random
import shutil
import stat
import subprocess
import sys

import pytest

from layerfs.errors import ImageFormatError, NativeError
from layerfs.mount import mounted_erofs, mounted_overlay
from layerfs.tree import Data, Inode, Tree, new_dir
from layerfs.writer import WriterOptions, write_image
from tests.layerfs.conftest import fsck_erofs
from tests.layerfs.treecmp import assert_same, snapshot_dir, snapshot_tree

S = 1_000_000_000
CAP_V2 = bytes.fromhex("01000002") + bytes.fromhex("00200000") + bytes(12)  # cap_net_raw+ep


def _src(d: pathlib.Path, name: str, data: bytes) -> Data:
    p = d / name
    p.write_bytes(data)
    return Data(str(p))


def reg(d: pathlib.Path, name: str, data: bytes, mode: int = 0o644, **kw: object) -> Inode:
    return Inode(mode=stat.S_IFREG | mode, size=len(data), data=_src(d, name, data),
                 **kw)  # type: ignore[arg-type]


def feature_tree(d: pathlib.Path) -> Tree:
    """A tree with every kind of entry and metadata the writer must keep."""
    rnd = random.Random(42)
    t = Tree(new_dir(0o755, mtime_ns=1_600_000_000 * S))
    t.put("empty", Inode(mode=stat.S_IFREG | 0o600, mtime_ns=5))
    t.put("small", reg(d, "small", b"hello\n", mtime_ns=1_700_000_000 * S + 123_456_789,
                       xattrs={b"user.k": b"v", b"trusted.t": b"\0\1",
                               b"security.capability": CAP_V2}))
    t.put("block", reg(d, "block", rnd.randbytes(4096)))
    t.put("tail", reg(d, "tail", rnd.randbytes(3 * 4096 + 1000), mode=0o4755))
    t.put("nearly", reg(d, "nearly", rnd.randbytes(4095), mode=0o2711))
    big = reg(d, "big", rnd.randbytes((1 << 20) + 77), uid=100000, gid=200000)
    t.put("sub/big", big)
    t.put("sub/big-link", big)
    t.put("sub/sticky", new_dir(0o1777, uid=65536, gid=3, mtime_ns=-S - 1))
    t.put("sub/sticky/neg", Inode(mode=stat.S_IFREG | 0o644, mtime_ns=-123))
    t.put("!bang", Inode(mode=stat.S_IFREG | 0o644))
    t.put("-dash", Inode(mode=stat.S_IFDIR | 0o700, children={}))
    t.put("link", Inode(mode=stat.S_IFLNK | 0o777, target=b"small", size=5))
    t.put("longlink", Inode(mode=stat.S_IFLNK | 0o777, target=b"x/" * 2000 + b"y",
                            size=4001))
    t.put("dev/null", Inode(mode=stat.S_IFCHR | 0o666, rdev_major=1, rdev_minor=3))
    t.put("dev/pts9", Inode(mode=stat.S_IFCHR | 0o620, rdev_major=136, rdev_minor=300))
    t.put("dev/sda", Inode(mode=stat.S_IFBLK | 0o660, rdev_major=4095, rdev_minor=0xFFFFF))
    t.put("dev/fifo", Inode(mode=stat.S_IFIFO | 0o600))
    t.put("dev/sock", Inode(mode=stat.S_IFSOCK | 0o755))
    t.put("dev/whiteout", Inode(mode=stat.S_IFCHR))
    t.put("opaque", new_dir(0o755))
    opaque = t.get("opaque")
    assert opaque is not None
    opaque.xattrs = {b"trusted.overlay.opaque": b"y", b"user.overlay.opaque": b"y"}
    t.put("acl", Inode(mode=stat.S_IFREG | 0o640, xattrs={
        b"system.posix_acl_access": bytes.fromhex(
            "02000000" "01000600ffffffff" "02000400e8030000" "04000400ffffffff"
            "10000400ffffffff" "20000000ffffffff")}))
    t.put("bigx", Inode(mode=stat.S_IFREG | 0o644,
                        xattrs={b"user.%d" % i: rnd.randbytes(200) for i in range(40)}))
    t.put(b"utf8-\xc3\xa9-and-\xff", Inode(mode=stat.S_IFREG | 0o644))
    return t


def roundtrip(tree: Tree, image: pathlib.Path, options: WriterOptions | None = None) -> None:
    write_image(tree, image, options)
    fsck_erofs(image)
    with mounted_erofs(image) as mp:
        assert_same(snapshot_dir(mp), snapshot_tree(tree))


@pytest.mark.mount
def test_every_feature_roundtrips(scratch: pathlib.Path) -> None:
    roundtrip(feature_tree(scratch), scratch / "img.erofs")


def test_image_is_sane_without_mounting(scratch: pathlib.Path) -> None:
    st = write_image(feature_tree(scratch), scratch / "img.erofs")
    raw = (scratch / "img.erofs").read_bytes()
    assert st.size == len(raw) and st.size % 4096 == 0
    assert raw[1024:1028] == bytes.fromhex("e2e1f5e0")
    assert st.inodes == 25 and st.files == 11
    fsck_erofs(scratch / "img.erofs")


def test_big_file_is_chunk_aligned(scratch: pathlib.Path) -> None:
    payload = os.urandom(3 << 20)
    t1, t2 = Tree(), Tree()
    t1.put("a/f", reg(scratch, "f", payload))
    t2.put("other", reg(scratch, "o", b"x" * 9999))
    t2.put("z/y/f", reg(scratch, "f2", payload, uid=7))
    chunks = []
    for i, t in enumerate((t1, t2)):
        img = scratch / f"{i}.erofs"
        write_image(t, img)
        raw = img.read_bytes()
        start = raw.find(payload[:4096])
        assert start > 0 and start % (1 << 20) == 0
        chunks.append({hashlib.sha256(raw[o:o + (1 << 20)]).digest()
                       for o in range(0, len(raw), 1 << 20)})
        fsck_erofs(img)
    assert len(chunks[0] & chunks[1]) >= 3  # the file's chunks are shared


@pytest.mark.mount
def test_directory_with_thousands_of_long_names(scratch: pathlib.Path) -> None:
    t = Tree()
    names = [b"%05d-" % i + b"n" * 249 for i in range(2000)]
    names += [b"%d" % i for i in range(2000)] + [b"!", b"-", b"~" * 255, b"\x01"]
    for n in names:
        t.put((b"big", n), Inode(mode=stat.S_IFREG | 0o644))
    img = scratch / "img.erofs"
    write_image(t, img)
    fsck_erofs(img)
    with mounted_erofs(img) as mp:
        d = os.path.join(os.fsencode(mp), b"big")
        assert sorted(os.listdir(d)) == sorted(names)
        for n in names[::97] + names[-4:]:
            assert stat.S_ISREG(os.lstat(os.path.join(d, n)).st_mode)
        with pytest.raises(FileNotFoundError):
            os.lstat(os.path.join(d, b"00000-"))
        assert_same(snapshot_dir(mp), snapshot_tree(t))


@pytest.mark.mount
def test_sparse_file_over_4gib(scratch: pathlib.Path) -> None:
    src = scratch / "sparse"
    size = (5 << 30) + 12345
    with open(src, "wb") as f:
        f.truncate(size)
        for off in (0, 1 << 30, (4 << 30) + 100, size - 10):
            f.seek(off)
            f.write(b"DATA@%d" % off)
    t = Tree()
    t.put("hole", Inode(mode=stat.S_IFREG | 0o644, size=size, data=Data(
        str(src), 0, ((0, 11, 0), (1 << 30, 16, 1 << 30),
                      ((4 << 30) + 100, 16, (4 << 30) + 100), (size - 10, 10, size - 10)))))
    t.put("allhole", Inode(mode=stat.S_IFREG | 0o644, size=size, data=Data(str(src), 0, ())))
    img = scratch / "img.erofs"
    st = write_image(t, img)
    assert st.size < 4 << 20  # holes stay holes
    fsck_erofs(img)
    with mounted_erofs(img) as mp:
        with open(os.path.join(mp, "hole"), "rb") as f:
            assert os.fstat(f.fileno()).st_size == size
            for off in (0, 1 << 30, (4 << 30) + 100, size - 10):
                f.seek(off)
                want = b"DATA@%d" % off
                assert f.read(len(want)) == want[: size - off]
            f.seek((3 << 30) + 7)
            assert f.read(4096) == bytes(4096)
        with open(os.path.join(mp, "allhole"), "rb") as f:
            f.seek(size - 4096)
            assert f.read() == bytes(4096)


def test_deterministic_whatever_the_order(scratch: pathlib.Path) -> None:
    a, b = feature_tree(scratch), feature_tree(scratch)

    def shuffle(node: Inode) -> None:
        node.xattrs = dict(reversed(list(node.xattrs.items())))
        if node.children:
            node.children = dict(reversed(list(node.children.items())))
            for c in node.children.values():
                shuffle(c)

    shuffle(b.root)
    d1 = write_image(a, scratch / "a.erofs")
    d2 = write_image(b, scratch / "b.erofs")
    assert d1 == d2
    assert (scratch / "a.erofs").read_bytes() == (scratch / "b.erofs").read_bytes()
    # an actual change changes the bytes (and the derived uuid)
    small = b.get("small")
    assert small is not None
    small.uid = 1
    d3 = write_image(b, scratch / "c.erofs")
    assert d3.uuid != d1.uuid


@pytest.mark.mount
def test_clamp_epoch_uuid_volume(scratch: pathlib.Path) -> None:
    t = Tree(new_dir(mtime_ns=10 * S))
    t.put("old", Inode(mode=stat.S_IFREG | 0o644, mtime_ns=5 * S + 1))
    t.put("new", Inode(mode=stat.S_IFREG | 0o644, mtime_ns=2_000_000_000 * S + 9))
    uuid = bytes(range(16))
    opts = WriterOptions(clamp_mtime_ns=1_000_000_000 * S, epoch=10, uuid=uuid,
                         volume_name=b"layer")
    img = scratch / "img.erofs"
    st = write_image(t, img, opts)
    assert st.epoch == 10 and st.uuid == uuid
    raw = img.read_bytes()
    assert raw[1024 + 48:1024 + 64] == uuid and raw[1024 + 64:1024 + 69] == b"layer"
    fsck_erofs(img)
    with mounted_erofs(img) as mp:
        assert os.lstat(os.path.join(mp, "new")).st_mtime_ns == 1_000_000_000 * S
        assert os.lstat(os.path.join(mp, "old")).st_mtime_ns == 5 * S + 1
        assert os.lstat(mp).st_mtime_ns == 10 * S


@pytest.mark.mount
def test_whiteout_and_opaque_under_overlay(scratch: pathlib.Path) -> None:
    lower, upper = Tree(), Tree()
    lower.put("a", reg(scratch, "a", b"a"))
    lower.put("keep", reg(scratch, "k", b"k"))
    lower.put("d/x", reg(scratch, "x", b"x"))
    upper.put("a", Inode(mode=stat.S_IFCHR))  # whiteout
    upper.put("d", new_dir())
    upper.put("d/y", reg(scratch, "y", b"y"))
    d = upper.get("d")
    assert d is not None
    d.xattrs[b"trusted.overlay.opaque"] = b"y"
    upper.root.xattrs[b"trusted.overlay.origin"] = b""
    write_image(lower, scratch / "lower.erofs")
    write_image(upper, scratch / "upper.erofs")
    with mounted_erofs(scratch / "lower.erofs") as lo, \
            mounted_erofs(scratch / "upper.erofs") as up, \
            mounted_overlay([up, lo]) as ov:
        assert sorted(os.listdir(ov)) == ["d", "keep"]
        assert os.listdir(os.path.join(ov, "d")) == ["y"]
        assert pathlib.Path(ov, "keep").read_bytes() == b"k"


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda t: t.root.children.__setitem__(b"a/b", Inode(mode=stat.S_IFREG)), "a/b"),
    (lambda t: t.root.children.__setitem__(b"a\0b", Inode(mode=stat.S_IFREG)), "NUL"),
    (lambda t: t.root.children.__setitem__(b"", Inode(mode=stat.S_IFREG)), "name length"),
    (lambda t: t.root.children.__setitem__(b"x" * 256, Inode(mode=stat.S_IFREG)),
     "name length"),
    (lambda t: t.root.children.__setitem__(b"..", Inode(mode=stat.S_IFREG)), "dot"),
    (lambda t: t.put("f", Inode(mode=0o170644)), "bad mode"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG | 0o10000)), "bad mode"),
    (lambda t: t.put("l", Inode(mode=stat.S_IFLNK | 0o777, target=b"")), "symlink target"),
    (lambda t: t.put("l", Inode(mode=stat.S_IFLNK | 0o777, target=b"a\0")), "NUL"),
    (lambda t: t.put("c", Inode(mode=stat.S_IFCHR, rdev_major=4096)), "out of range"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG, xattrs={b"os2.x": b""})), "os2.x"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG, xattrs={b"user.x": bytes(65536)})),
     "too long"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG, size=10)), "without data"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG, size=-1, data=Data("/x"))), "/f"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG, size=1 << 63, data=Data("/x"))),
     "too large"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG, size=10, data=Data(
        "/x", 0, ((5, 5, 0), (0, 5, 0)))))
     , "extent"),
    (lambda t: t.put("f", Inode(mode=stat.S_IFREG, uid=1 << 32)), "/f"),
    (lambda t: (t.put("d", new_dir()), t.root.children.__setitem__(b"e", t.get("d"))),
     "linked more than once"),
])
def test_bad_input_is_refused(scratch: pathlib.Path, mutate: object, needle: str) -> None:
    t = Tree()
    t.put("ok", Inode(mode=stat.S_IFREG))
    mutate(t)  # type: ignore[operator]
    out = scratch / "img.erofs"
    with pytest.raises(ImageFormatError) as ei:
        write_image(t, out)
    assert needle in str(ei.value)
    assert not out.exists() and not any(n.endswith(".tmp") for n in os.listdir(scratch))


@pytest.mark.parametrize("how", ["vanished", "shrank"])
def test_changed_source_is_an_io_error(scratch: pathlib.Path, how: str) -> None:
    t = Tree()
    t.put("dir/f", reg(scratch, "f", os.urandom(10000)))
    if how == "vanished":
        (scratch / "f").unlink()
    else:
        os.truncate(scratch / "f", 5000)
    out = scratch / "img.erofs"
    with pytest.raises(NativeError) as ei:
        write_image(t, out)
    assert str(scratch / "f") in str(ei.value) and "/dir/f" in str(ei.value)
    assert isinstance(ei.value, OSError)
    assert not out.exists() and not any(n.endswith(".tmp") for n in os.listdir(scratch))


def test_write_to_fd(scratch: pathlib.Path) -> None:
    t = feature_tree(scratch)
    write_image(t, scratch / "a.erofs")
    with open(scratch / "b.erofs", "wb") as f:
        f.write(b"garbage" * 100000)
        f.flush()
        st = write_image(t, f.fileno())
    assert (scratch / "b.erofs").read_bytes() == (scratch / "a.erofs").read_bytes()
    assert st.size == os.path.getsize(scratch / "a.erofs")
    r, w = os.pipe()
    try:
        with pytest.raises(NativeError, match="not a regular file"):
            write_image(t, w)
    finally:
        os.close(r)
        os.close(w)


_TRUNCATE_CHILD = """
import os, sys
from layerfs.sources.directory import scan_directory
from layerfs.writer import write_image
src, out, garbage = sys.argv[1:]
fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
os.write(fd, b"x" * int(garbage))
write_image(scan_directory(src), fd)
os.close(fd)
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (scripts/install.sh)")
def test_an_empty_output_is_not_truncated(scratch: pathlib.Path) -> None:
    """ext4 takes ftruncate(fd, 0), even of an empty file, as a file being replaced
    (auto_da_alloc: ext4_truncate() marks it, ext4_release_file() then starts the
    writeback of all of it at close): 84-136 ms of a Debian rootfs build's wall time
    went there.  The writer truncates only an output that holds bytes."""
    src = scratch / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(20000))
    calls = {}
    for garbage in (0, 10000):
        log, out = scratch / f"strace-{garbage}", scratch / f"img-{garbage}.erofs"
        subprocess.run(["strace", "-f", "-qq", "-e", "trace=ftruncate", "-o", str(log),
                        sys.executable, "-c", _TRUNCATE_CHILD, str(src), str(out),
                        str(garbage)], check=True)
        calls[garbage] = [ln for ln in log.read_text().splitlines() if "ftruncate(" in ln]
    assert not [c for c in calls[0] if ", 0)" in c], calls[0]
    assert [c for c in calls[10000] if ", 0)" in c], calls[10000]   # garbage: truncated
    assert (scratch / "img-0.erofs").read_bytes() == (scratch / "img-10000.erofs").read_bytes()


_RSS_CHILD = """
import os, resource, stat, sys
from layerfs.tree import Data, Inode, Tree
from layerfs.writer import write_image
src, size, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t = Tree()
if size:
    t.put("flat", Inode(mode=stat.S_IFREG | 0o644, size=size, data=Data(src)))
    t.put("sparse", Inode(mode=stat.S_IFREG | 0o644, size=2 * size,
                          data=Data(src, 0, ((size, size, 0),))))
write_image(t, out)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_memory_does_not_grow_with_file_size(scratch: pathlib.Path) -> None:
    src = scratch / "src"
    size = 192 << 20
    with open(src, "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
    rss = []
    for n in (0, size):
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(src), str(n),
                            str(scratch / "img.erofs")], capture_output=True, text=True,
                           check=True)
        rss.append(int(r.stdout))
    assert os.path.getsize(scratch / "img.erofs") > 2 * size  # both copies written
    assert rss[1] - rss[0] < 16 << 10, f"peak RSS {rss} KiB"  # ru_maxrss is in KiB


# -- sparse files whose layout cannot be compact; the file size cap ----------------------

def _sparse_tar(path: pathlib.Path, realsize: int, extents: list[tuple[int, int]]) -> None:
    import tarfile

    data = b"".join(b"x" * n for _, n in extents)
    t = tarfile.TarInfo("sp")
    t.size = len(data)
    t.pax_headers = {"GNU.sparse.name": "sp", "GNU.sparse.realsize": str(realsize),
                     "GNU.sparse.map": ",".join(f"{o},{n}" for o, n in extents)}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(t, __import__("io").BytesIO(data))


_SPARSE_CHILD = """
import sys, time
from layerfs.errors import ImageFormatError
from layerfs.sources.tar import load_tar
from layerfs.writer import write_image
tar, work, out = sys.argv[1:4]
t0 = time.monotonic()
try:
    write_image(load_tar(tar, workdir=work), out)
    print("WROTE")
except ImageFormatError as exc:
    print("REFUSED", exc)
# VmHWM is this program's peak (ru_maxrss would include the forking pytest's).
hwm = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(time.monotonic() - t0, hwm)
"""


@pytest.mark.parametrize("case", ["two far extents", "200k one-byte extents"])
def test_sparse_file_too_scattered_is_refused_fast(scratch: pathlib.Path, case: str) -> None:
    # Found by review: 2^63-1 bytes with two 4-byte extents made a 16 GiB image in 99 s
    # with 8.4 GB of memory; 200k one-byte extents a 1.8 GiB image.
    if case == "two far extents":
        size, ext = 2**63 - 1, [(0, 4), (2**63 - 5, 4)]
    else:
        size, ext = 200_000 * 8192, [(k * 8192, 1) for k in range(200_000)]
    tar = scratch / "sp.tar"
    _sparse_tar(tar, size, ext)
    work = scratch / "work"
    work.mkdir()
    out = scratch / "img.erofs"
    r = subprocess.run([sys.executable, "-c", _SPARSE_CHILD, str(tar), str(work), str(out)],
                       capture_output=True, text=True, check=True, timeout=120)
    lines = r.stdout.splitlines()
    secs, rss_kib = lines[-1].split()
    assert lines[0].startswith("REFUSED") and "entry /sp" in lines[0], r.stdout
    assert ("too large" in lines[0]) if size > 1 << 62 else ("sparse" in lines[0])
    assert float(secs) < 20 and int(rss_kib) < 400 << 10, lines[-1]
    assert not out.exists()


def test_sparse_layout_bound_refuses_scattered_extents(scratch: pathlib.Path) -> None:
    src = scratch / "s"
    src.write_bytes(b"\1" * 4096)
    t = Tree()
    # 64 GiB apart, 1 byte each: every chunk size needs over 512 MiB of map + chunks,
    # far more than 4 x data + 64 MiB.
    ext = tuple((k << 36, 1, 0) for k in range(1000))
    t.put("sparse", Inode(mode=stat.S_IFREG | 0o644, size=1000 << 36,
                          data=Data(str(src), 0, ext)))
    # 200 extents 1 GiB apart fit in 64 KiB chunks (~26 MB of map + chunks): accepted.
    ext = tuple((k << 30, 1, 0) for k in range(200))
    ok = Tree()
    ok.put("sparse", Inode(mode=stat.S_IFREG | 0o644, size=200 << 30,
                           data=Data(str(src), 0, ext)))
    assert write_image(ok, scratch / "ok.erofs").size < 64 << 20
    with pytest.raises(ImageFormatError, match=r"entry /sparse .*smallest EROFS layout"):
        write_image(t, scratch / "img.erofs")
    assert not (scratch / "img.erofs").exists()


@pytest.mark.mount
def test_largest_file_size_has_sane_stat(scratch: pathlib.Path) -> None:
    # i_blocks = round_up(i_size, 4096) >> 9 in a signed loff_t (fs/erofs/inode.c):
    # negative st_blocks near 2^63, so 2^62 is the cap; 2^62 + 1 is refused.
    # (Data in such a file is not representable compactly: see the layout bound.)
    src = scratch / "s"
    src.write_bytes(b"head")
    t = Tree()
    t.put("big", Inode(mode=stat.S_IFREG | 0o644, size=1 << 62, data=Data(str(src), 0, ())))
    img = scratch / "img.erofs"
    assert write_image(t, img).size < 4 << 20
    with mounted_erofs(img) as mp:
        st = os.stat(os.path.join(mp, "big"))
        assert st.st_size == 1 << 62 and st.st_blocks >= 0
        with open(os.path.join(mp, "big"), "rb") as f:
            f.seek((1 << 62) - 4096)
            assert f.read() == bytes(4096)
    t.put("big", Inode(mode=stat.S_IFREG | 0o644, size=(1 << 62) + 1,
                       data=Data(str(src), 0, ())))
    with pytest.raises(ImageFormatError, match=r"/big .*too large"):
        write_image(t, img)


# -- a source changed between the scan and the write -------------------------------------

def _swap(p: pathlib.Path, how: str, secret: pathlib.Path) -> None:
    if how == "symlink":
        p.unlink()
        os.symlink(secret, p)
    elif how == "chardev":
        p.unlink()
        os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 3))
    elif how == "fifo":
        p.unlink()
        os.mkfifo(p)
    elif how == "grew":
        with open(p, "ab") as f:
            f.write(b"more")
    elif how == "rewritten":
        p.write_bytes(b"B" * 10000)  # same size, new contents and mtime
        os.utime(p, ns=(0, 5 * S))
    elif how == "replaced":
        tmp = p.with_name("new")
        tmp.write_bytes(p.read_bytes())
        os.utime(tmp, ns=(os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns))
        os.rename(tmp, p)


@pytest.mark.parametrize("how", [
    "symlink", pytest.param("chardev", marks=pytest.mark.root), "fifo", "grew", "rewritten",
    "replaced"])
def test_source_swapped_after_scan_is_refused(scratch: pathlib.Path, how: str) -> None:
    from layerfs.sources.directory import load_directory

    if how == "chardev" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    secret = scratch / "secret"
    secret.write_bytes(b"SECRET" * 2000)
    src = scratch / "src"
    (src / "sub").mkdir(parents=True)
    f = src / "sub" / "f"
    f.write_bytes(b"A" * 10000)
    os.utime(f, ns=(0, 1 * S))
    tree = load_directory(src)
    _swap(f, how, secret)
    out = scratch / "img.erofs"
    with pytest.raises((ImageFormatError, NativeError)) as ei:
        write_image(tree, out)
    msg = str(ei.value)
    assert str(f) in msg and "entry /sub/f" in msg, msg
    assert not out.exists() and not any(".tmp" in n for n in os.listdir(scratch))


@pytest.mark.parametrize("how", ["symlink", "fifo"])
def test_source_without_identity_is_never_followed_or_blocked_on(scratch: pathlib.Path,
                                                                 how: str) -> None:
    secret = scratch / "secret"
    secret.write_bytes(b"SECRET" * 2000)
    p = scratch / "f"
    p.write_bytes(b"A" * 10000)
    t = Tree()
    t.put("f", Inode(mode=stat.S_IFREG | 0o644, size=10000, data=Data(str(p))))
    _swap(p, how, secret)
    with pytest.raises(ImageFormatError, match=r"entry /f .*(symlink|not a regular file)"):
        write_image(t, scratch / "img.erofs")


def test_tar_in_place_changed_after_scan_is_refused(scratch: pathlib.Path) -> None:
    import io
    import tarfile

    from layerfs.sources.tar import load_tar

    tar = scratch / "a.tar"
    with tarfile.open(tar, "w") as tf:
        ti = tarfile.TarInfo("dir/f")
        ti.size = 5000
        tf.addfile(ti, io.BytesIO(b"x" * 5000))
    work = scratch / "work"
    work.mkdir()
    tree = load_tar(tar, workdir=work)
    node = tree.get("dir/f")
    assert node is not None and node.data is not None and node.data.path == str(tar)
    with open(tar, "ab") as f:
        f.write(bytes(10240))
    with pytest.raises(ImageFormatError, match=r"entry /dir/f .*a.tar.* changed"):
        write_image(tree, scratch / "img.erofs")


def test_writer_thread_gives_the_same_bytes(scratch: pathlib.Path) -> None:
    # The second thread only pwrite()s buffers that carry their own offsets.
    tree = feature_tree(scratch)
    digests = set()
    for threaded in (True, False, True):
        img = scratch / f"{threaded}.erofs"
        write_image(tree, img, WriterOptions(threaded=threaded))
        digests.add(hashlib.sha256(img.read_bytes()).hexdigest())
    assert len(digests) == 1


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("threaded", [True, False], ids=["writer-thread", "one-thread"])
def test_full_disk_is_an_io_error_naming_where(scratch: pathlib.Path,
                                                    threaded: bool) -> None:
    tree = Tree()
    tree.put("big", reg(scratch, "big", os.urandom(6 << 20)))
    for i in range(200):  # small files: many buffers handed to the writer thread
        tree.put(f"f{i}", reg(scratch, f"f{i}", os.urandom(9000)))
    mnt = scratch / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "lfs-writer-test", str(mnt)],
                   check=True)
    try:
        fd = os.open(mnt / "img.erofs", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # Either a buffer's write or a big file's copy fails: the offset or the
            # entry is named.
            with pytest.raises(NativeError,
                               match=r"write image at offset \d+|entry /big .*into the image"
                               ) as ei:
                write_image(tree, fd, WriterOptions(threaded=threaded))
        finally:
            os.close(fd)
        assert ei.value.errno == errno.ENOSPC
        with pytest.raises(NativeError, match="write image") as ei:  # through a path too
            write_image(tree, mnt / "img2.erofs", WriterOptions(threaded=threaded))
        assert sorted(os.listdir(mnt)) == ["img.erofs"]  # the temp file is gone
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.mount
@pytest.mark.parametrize("last", ["empty-file", "fifo", "chardev"])
def test_last_inode_ending_at_the_image_end(scratch: pathlib.Path, last: str) -> None:
    """An image whose data is all inline ends where its metadata ends; when the last
    inode there has no xattrs and no inline data and fills its block to the end,
    fsck.erofs (erofs-utils 1.5 and later: erofs_verify_xattr() reads the 12-byte
    xattr ibody header of every inode, even one without xattrs) read past the image
    end and called it corrupt.  The root here (nid 36 at byte 1152, compact: 32 bytes
    + 2800 of xattrs + 40 inline dirent bytes) ends at 4024, so the one child, extended
    (uid > 65535: 64 bytes), sits at 4032 and ends at 4096."""
    root = new_dir(0o755)
    root.xattrs = {b"user.a": b"v" * 2783}  # 12 + align4(4 + 1 + 2783) = 2800 bytes
    tree = Tree(root)
    if last == "empty-file":
        child = reg(scratch, "f", b"", uid=100000)
    elif last == "fifo":
        child = Inode(mode=stat.S_IFIFO | 0o600, uid=100000)
    else:
        child = Inode(mode=stat.S_IFCHR | 0o4600, uid=100000, rdev_major=1, rdev_minor=3)
    tree.put("f", child)
    image = scratch / "img.erofs"
    st = write_image(tree, image)
    raw = image.read_bytes()
    # the root's dirents, sorted: ".", "..", "f"
    nid = int.from_bytes(raw[1152 + 32 + 2800 + 2 * 12:][:8], "little")
    assert nid * 32 + 64 == 4096  # the layout this test is about: child ends at 4096
    roundtrip(tree, image)
    assert st.size == len(raw) == 8192  # one zero block after the metadata
