"""Tests of the chunk store (layerfs.store) on crafted image files.

The store treats an image as opaque bytes, so these tests use files with chosen contents
(random, zeros, shared regions at chunk-aligned offsets) where it matters exactly which
bytes repeat; the end-to-end tests with real EROFS images are in test_build.py. The crafted
files are laid out in 1 MiB units, so the stores here use 1 MiB chunks, not the default.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from layerfs.errors import CorruptError, LayerfsError, NotFoundError, StoreError
from layerfs.manifest import InvalidArgumentError, Manifest
from layerfs.store import Store

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def write_image(path: Path, *parts: bytes) -> Path:
    path.write_bytes(b"".join(parts))
    return path


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_round_trip_export_equals_image(tmp_path: Path) -> None:
    data = rand(3 * MiB + 12345, 1) + bytes(2 * MiB) + b"tail"
    img = write_image(tmp_path / "a.img", data)
    store = Store(tmp_path / "store", chunk_size=MiB)
    m = store.add_image(img, kind="base", source="test:a")
    assert m.digest == sha(data)
    assert m.size == len(data)
    assert m.chunk_size == MiB
    assert len(m.chunks) == 6
    assert [c.digest for c in m.chunks[:3]] == [sha(data[i * MiB:(i + 1) * MiB])
                                                 for i in range(3)]
    assert m.kind == "base" and m.source == "test:a" and m.created.endswith("Z")

    out = tmp_path / "out.img"
    store.export(m.digest, out)
    assert out.read_bytes() == data
    buf = io.BytesIO()
    store.export(m.digest, buf)
    assert buf.getvalue() == data
    assert store.read_chunk(m.chunks[0].digest) == data[:MiB]
    assert store.manifest(m.digest) == m
    assert store.layers() == [m]
    assert store.verify().ok


def test_manifest_is_canonical_json_named_by_digest(tmp_path: Path) -> None:
    img = write_image(tmp_path / "a.img", rand(MiB + 1, 2))
    store = Store(tmp_path / "store", chunk_size=MiB)
    m = store.add_image(img, kind="toolkit", source="x")
    raw = (tmp_path / "store" / "manifests" / (m.digest[7:] + ".json")).read_bytes()
    obj = json.loads(raw)
    assert raw == (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()
    assert obj["format"] == 1 and obj["digest"] == m.digest and obj["size"] == MiB + 1
    assert Manifest.from_json(raw) == m
    assert (tmp_path / "store" / "layout-version").read_text() == "1\n"


def test_empty_image_and_small_chunk_size(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", chunk_size=64 << 10)
    empty = store.add_image(write_image(tmp_path / "e.img", b""), kind="base", source="")
    assert empty.size == 0 and empty.chunks == () and empty.digest == sha(b"")
    data = rand(300 << 10, 3)
    m = store.add_image(write_image(tmp_path / "s.img", data), kind="base", source="")
    assert len(m.chunks) == 5 and m.chunk_length(4) == (300 - 256) << 10
    out = tmp_path / "out"
    store.export(m.digest, out)
    assert out.read_bytes() == data
    store.export(empty.digest, out)
    assert out.read_bytes() == b""


def test_dedup_two_layers_sharing_50_mib_store_it_once(tmp_path: Path) -> None:
    shared = rand(50 * MiB, 4)
    # The writer aligns big files to chunk boundaries; place the shared bytes likewise,
    # after different metadata and followed by different tails.
    a = write_image(tmp_path / "a.img", rand(MiB, 5), shared, rand(100_000, 6))
    b = write_image(tmp_path / "b.img", rand(2 * MiB, 7), shared, rand(200_000, 8))
    store = Store(tmp_path / "store", chunk_size=MiB)
    ra = store.ingest(a, kind="base", source="a")
    rb = store.ingest(b, kind="workspace", source="b")
    assert rb.reused_chunks == 50
    assert rb.new_chunks == 3  # two head chunks and a tail
    use = store.usage()
    assert use.chunks == 1 + 50 + 1 + 2 + 1
    # Random bytes do not compress: what is on disk is ~ one copy of the shared file.
    assert use.chunk_bytes == ra.new_bytes + rb.new_bytes
    assert 50 * MiB < use.chunk_bytes < 50 * MiB + 3 * MiB + 400_000
    assert use.chunk_bytes < (a.stat().st_size + b.stat().st_size) * 0.6


def test_zero_chunks_dedupe(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", chunk_size=MiB)
    r = store.ingest(write_image(tmp_path / "z.img", bytes(8 * MiB)), kind="base", source="")
    assert r.new_chunks == 1 and r.reused_chunks == 7
    assert store.usage().chunks == 1
    assert store.usage().chunk_bytes < 4096


def test_already_stored_layer_keeps_its_manifest(tmp_path: Path) -> None:
    img = write_image(tmp_path / "a.img", rand(2 * MiB, 9))
    store = Store(tmp_path / "store", chunk_size=MiB)
    first = store.add_image(img, kind="base", source="one")
    again = store.ingest(img, kind="base", source="two")
    assert again.manifest == first and again.new_chunks == 0


def test_bad_arguments_are_refused_clearly(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", chunk_size=MiB)
    img = write_image(tmp_path / "a.img", b"x")
    with pytest.raises(InvalidArgumentError, match="kind 'rootfs' is not one of"):
        store.add_image(img, kind="rootfs", source="")
    with pytest.raises(ValueError, match="power of two"):
        store.add_image(img, kind="base", source="", chunk_size=5000)
    with pytest.raises(ValueError, match="power of two"):
        Store(tmp_path / "s2", chunk_size=1024)
    with pytest.raises(ValueError, match="not a digest"):
        store.manifest("sha256:xyz")
    missing = "sha256:" + "0" * 64
    with pytest.raises(NotFoundError, match="is not in store"):
        store.manifest(missing)
    with pytest.raises(KeyError):
        store.remove(missing)
    with pytest.raises(NotFoundError):
        store.read_chunk(missing)
    with pytest.raises(NotFoundError):
        store.verify(missing)
    with pytest.raises(StoreError, match=r"[Nn]o such file"):
        store.add_image(tmp_path / "nope.img", kind="base", source="")
    assert store.layers() == []
    assert not list((tmp_path / "store" / "tmp").iterdir())


def test_resolve_prefix(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", chunk_size=MiB)
    m = store.add_image(write_image(tmp_path / "a.img", b"abc"), kind="base", source="")
    assert store.resolve(m.digest[:14]) == m.digest
    assert store.resolve(m.digest[7:19]) == m.digest
    with pytest.raises(NotFoundError):
        store.resolve("ffff" if not m.digest[7:].startswith("ffff") else "0000")
    with pytest.raises(InvalidArgumentError):
        store.resolve("ab")


# -- corruption -------------------------------------------------------------------------


def _chunk_file(store_root: Path, digest: str) -> Path:
    return store_root / "chunks" / digest[7:9] / digest[7:]


def test_corrupt_chunk_is_named_by_verify_and_refused_by_export(tmp_path: Path) -> None:
    data = rand(4 * MiB, 10)
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    m = store.add_image(write_image(tmp_path / "a.img", data), kind="base", source="")
    other = store.add_image(write_image(tmp_path / "b.img", rand(MiB, 11)), kind="base",
                            source="")
    bad = m.chunks[2].digest
    f = _chunk_file(root, bad)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    f.write_bytes(bytes(raw))

    with pytest.raises(CorruptError, match=r"does not match its digest|does not decompress"):
        store.read_chunk(bad)
    rep = store.verify()
    assert not rep.ok
    assert list(rep.bad_chunks) == [bad]
    assert list(rep.bad_layers) == [m.digest]
    assert bad in rep.bad_layers[m.digest]
    assert list(rep.quarantined) == [bad]  # moved aside: see test_store_repair.py
    assert store.verify(other.digest).ok

    out = tmp_path / "out.img"
    out.write_bytes(b"previous")
    with pytest.raises(CorruptError, match=bad):
        store.export(m.digest, out)
    assert out.read_bytes() == b"previous"  # untouched, no temp file left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.img", "b.img", "out.img", "store"]


def test_truncated_and_missing_chunks(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    m = store.add_image(write_image(tmp_path / "a.img", rand(3 * MiB, 12)), kind="base",
                        source="")
    f0 = _chunk_file(root, m.chunks[0].digest)
    f0.write_bytes(f0.read_bytes()[:100])
    _chunk_file(root, m.chunks[1].digest).unlink()
    rep = store.verify(m.digest)
    assert set(rep.bad_chunks) == {m.chunks[0].digest, m.chunks[1].digest}
    assert "missing" in rep.bad_chunks[m.chunks[1].digest]
    with pytest.raises(CorruptError):
        store.export(m.digest, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_chunk_swapped_for_another_valid_chunk_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    m = store.add_image(write_image(tmp_path / "a.img", rand(2 * MiB, 13)), kind="base",
                        source="")
    a, b = (_chunk_file(root, c.digest) for c in m.chunks)
    a.write_bytes(b.read_bytes())  # valid zstd, wrong content for its name
    assert m.chunks[0].digest in store.verify().bad_chunks


def test_corrupt_manifest(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    m = store.add_image(write_image(tmp_path / "a.img", rand(MiB, 14)), kind="base",
                        source="")
    mf = root / "manifests" / (m.digest[7:] + ".json")
    mf.write_bytes(mf.read_bytes()[:-20])
    with pytest.raises(CorruptError, match="not valid JSON"):
        store.manifest(m.digest)
    rep = store.verify()
    assert m.digest in rep.bad_layers
    # gc cannot know what a damaged manifest references, so it removes nothing.
    with pytest.raises(CorruptError):
        store.gc()
    assert store.usage().chunks == 1


def test_manifest_of_newer_format_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    m = store.add_image(write_image(tmp_path / "a.img", b"a"), kind="base", source="")
    mf = root / "manifests" / (m.digest[7:] + ".json")
    obj = json.loads(mf.read_bytes())
    obj["format"] = 2
    mf.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="newer than this layerfs knows"):
        store.manifest(m.digest)


# -- layout ------------------------------------------------------------------------------


def test_layout_version_refusal(tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store(root, chunk_size=MiB)
    (root / "layout-version").write_text("2\n")
    with pytest.raises(StoreError, match="layout version '2' is not one this layerfs knows"):
        Store(root, chunk_size=MiB)
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    with pytest.raises(StoreError, match="not a layerfs store"):
        Store(other)
    assert sorted(os.listdir(other)) == ["precious.txt"]
    with pytest.raises(NotFoundError, match="no layer store"):
        Store(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()


def test_half_made_layout_is_completed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "chunks").mkdir(parents=True)
    (root / "lock").write_bytes(b"")
    Store(root, chunk_size=MiB)
    assert (root / "layout-version").read_text() == "1\n"
    assert (root / "chunks" / "ff").is_dir()


# -- gc ------------------------------------------------------------------------------------


def test_gc_keeps_referenced_and_removes_unreferenced(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    shared = rand(2 * MiB, 15)
    a = store.add_image(write_image(tmp_path / "a.img", shared, rand(MiB, 16)), kind="base",
                        source="")
    b = store.add_image(write_image(tmp_path / "b.img", shared, rand(MiB, 17)), kind="base",
                        source="")
    (root / "tmp" / "chunk.stale").write_bytes(b"junk")
    assert store.usage().chunks == 4

    dry = store.gc(dry_run=True)
    assert (dry.chunks_kept, dry.chunks_removed, dry.temp_removed) == (4, 0, 1)
    assert (root / "tmp" / "chunk.stale").exists()

    store.remove(a.digest)
    with pytest.raises(NotFoundError):
        store.manifest(a.digest)
    dry = store.gc(dry_run=True)
    assert dry.chunks_removed == 1 and store.usage().chunks == 4
    rep = store.gc()
    assert (rep.chunks_kept, rep.chunks_removed, rep.temp_removed) == (3, 1, 1)
    assert rep.bytes_freed == a.chunks[2].stored_size
    assert not _chunk_file(root, a.chunks[2].digest).exists()
    assert not list((root / "tmp").iterdir())
    assert store.verify().ok
    out = tmp_path / "b.out"
    store.export(b.digest, out)
    assert out.read_bytes() == (tmp_path / "b.img").read_bytes()


# -- crash, disk full, concurrency ---------------------------------------------------------

_CRASHING_ADD = textwrap.dedent("""
    import os, sys, time
    import layerfs.store as st
    real_rename = os.rename
    n = 0
    def rename(src, dst):
        global n
        n += 1
        if n == 4:  # a chunk is written and fsynced in tmp/ but not yet renamed
            print("stuck", flush=True)
            time.sleep(600)
        return real_rename(src, dst)
    st.os.rename = rename
    s = st.Store(sys.argv[1], workers=1, chunk_size=1 << 20)
    s.add_image(sys.argv[2], kind="base", source="crash")
    print("finished", flush=True)
""")


def test_crash_mid_add_leaves_no_manifest_and_gc_cleans_up(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    data = rand(8 * MiB, 18)
    img = write_image(tmp_path / "a.img", data)
    proc = subprocess.Popen([sys.executable, "-c", _CRASHING_ADD, str(root), str(img)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stuck"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    assert store.layers() == []
    assert list((root / "tmp").iterdir())  # the dead writer's temp file
    assert store.usage().chunks == 3        # whole chunks no manifest references
    assert store.verify().ok                # nothing claims to be complete
    rep = store.gc()
    assert rep.chunks_removed == 3 and rep.temp_removed >= 1
    assert store.usage().chunks == 0 and not list((root / "tmp").iterdir())
    m = store.add_image(img, kind="base", source="retry")
    assert store.verify(m.digest).ok


_ADD = textwrap.dedent("""
    import json, sys
    from layerfs.store import Store
    s = Store(sys.argv[1], chunk_size=256 << 10)
    m = s.add_image(sys.argv[2], kind="base", source=sys.argv[2])
    print(json.dumps({"digest": m.digest}))
""")


def test_concurrent_adds_and_gc(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=256 << 10)
    shared = rand(12 * MiB, 19)
    imgs = [write_image(tmp_path / f"{i}.img", rand(256 << 10, 20 + i), shared,
                        rand(MiB, 30 + i)) for i in range(4)]
    # An unreferenced chunk that gc may remove while adds run: an add that dedups against
    # a chunk must never lose it to gc.
    junk = store.add_image(imgs[0], kind="base", source="junk")
    store.remove(junk.digest)
    procs = [subprocess.Popen([sys.executable, "-c", _ADD, str(root), str(p)],
                              stdout=subprocess.PIPE, text=True) for p in imgs]
    gc_reports = []
    try:
        while any(p.poll() is None for p in procs):
            gc_reports.append(store.gc())
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * 4
    assert len(gc_reports) > 1
    digests = {json.loads(o)["digest"] for o in outs}
    assert digests == {sha(p.read_bytes()) for p in imgs}
    rep = store.verify()
    assert rep.ok and rep.layers_checked == 4
    store.gc()
    assert store.verify().ok
    assert store.usage().chunks == 4 * (1 + 4) + 48


def test_concurrent_adds_of_the_same_image_in_threads(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", chunk_size=MiB)
    img = write_image(tmp_path / "a.img", rand(6 * MiB, 40))
    errors: list[BaseException] = []

    def add() -> None:
        try:
            store.add_image(img, kind="base", source="t")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.verify().ok and store.usage().chunks == 6


_MEM = textwrap.dedent("""
    import resource, sys
    from layerfs.store import Store
    s = Store(sys.argv[1], chunk_size=1 << 20)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s.add_image(sys.argv[2], kind="base", source="")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
""")


def test_add_streams_memory_does_not_grow_with_image_size(tmp_path: Path) -> None:
    img = tmp_path / "big.img"
    with open(img, "wb") as f:
        f.write(rand(4 * MiB, 41))
        f.truncate(768 * MiB)  # a sparse tail of zeros: cheap to make, long to read
    out = subprocess.run([sys.executable, "-c", _MEM, str(tmp_path / "store"), str(img)],
                         check=True, capture_output=True, text=True).stdout
    grew_kib = int(out)
    assert grew_kib < 64 * 1024, f"RSS grew {grew_kib} KiB adding a 768 MiB image"


@pytest.mark.root
@pytest.mark.mount
def test_disk_full_gives_clear_error_and_consistent_store(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "lfs-test", str(mnt)],
                   check=True)
    try:
        root = mnt / "store"
        store = Store(root, chunk_size=MiB)
        small = store.add_image(write_image(tmp_path / "s.img", rand(MiB, 42)), kind="base",
                                source="")
        big = write_image(tmp_path / "big.img", rand(12 * MiB, 43))
        with pytest.raises(StoreError) as ei:
            store.add_image(big, kind="base", source="")
        assert ei.value.errno == errno.ENOSPC
        assert "no space left on device; the layer was not added" in str(ei.value)
        assert str(big) in str(ei.value)
        assert isinstance(ei.value, LayerfsError)
        assert [m.digest for m in store.layers()] == [small.digest]
        assert not list((root / "tmp").iterdir())
        assert store.verify().ok
        store.gc()
        assert store.usage().chunks == 1
        again = store.add_image(write_image(tmp_path / "s2.img", rand(MiB, 44)), kind="base",
                                source="")
        assert store.verify(again.digest).ok
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_push_chunk_by_chunk_then_manifest(tmp_path: Path) -> None:
    from layerfs.store import RejectedError

    src = Store(tmp_path / "src", chunk_size=64 << 10)
    img = write_image(tmp_path / "a.img", rand(192 << 10, 7), bytes(128 << 10))
    m = src.add_image(img, kind="base", source="test")
    dst = Store(tmp_path / "dst")
    assert not dst.has_layer(m.digest)
    # a manifest before its chunks is refused, naming each missing chunk once
    with pytest.raises(RejectedError) as ei:
        dst.put_manifest(m)
    assert ei.value.missing == list(dict.fromkeys(c.digest for c in m.chunks))
    assert isinstance(ei.value, ValueError) and not dst.has_layer(m.digest)
    first = m.chunks[0].digest
    with pytest.raises(RejectedError, match="does not match its digest"):
        dst.put_chunk(first, b"not these bytes")
    assert not dst.has_chunk(first)
    with pytest.raises(InvalidArgumentError):
        dst.put_chunk("sha256:xyz", b"")
    news = [dst.put_chunk(c.digest, src.read_chunk(c.digest)) for c in m.chunks]
    assert news == [True, True, True, True, False]  # the second zero chunk is a duplicate
    assert dst.put_chunk(first, src.read_chunk(first)) is False
    assert dst.read_stored_chunk(first) and dst.read_chunk(first) == src.read_chunk(first)
    assert dst.put_manifest(m) is True and dst.put_manifest(m) is False
    assert dst.has_layer(m.digest) and dst.verify(m.digest).ok
    out = tmp_path / "out.img"
    dst.export(m.digest, out)
    assert out.read_bytes() == img.read_bytes()
    assert not os.listdir(tmp_path / "dst" / "tmp")
    with pytest.raises(NotFoundError):
        dst.read_stored_chunk("sha256:" + "0" * 64)
    # nowait: the stored bytes when the page cache holds them, None rather than a wait
    stored = dst.read_stored_chunk(first)
    assert dst.read_stored_chunk_nowait(first) == stored
    path = tmp_path / "dst" / "chunks" / first[7:9] / first[7:]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    fstype = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                            text=True, check=True).stdout.strip()
    if fstype != "tmpfs":  # tmpfs pages cannot be dropped; a disk file's then need the disk
        assert dst.read_stored_chunk_nowait(first) is None, fstype
    assert dst.read_stored_chunk(first) == stored  # waits for the disk
    assert dst.read_stored_chunk_nowait(first) == stored  # cached again
    with pytest.raises(NotFoundError):
        dst.read_stored_chunk_nowait("sha256:" + "0" * 64)
