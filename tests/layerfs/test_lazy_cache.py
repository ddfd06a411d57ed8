"""The node cache: versioned layout, per-layer sparse files with a persisted present
bitmap (never misread after a crash or a torn write), size limit with eviction by punching
holes, disk full."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import time
from collections.abc import Iterator

import pytest

from layerfs.build import build_layer
from layerfs.errors import StoreError
from layerfs.lazy.cache import LAYOUT, ChunkCache
from layerfs.mount import umount
from layerfs.store import Store
from tests.layerfs.lazy_helpers import CHUNK, RemoteThread, lazy_node, make_tree

DIGEST = "sha256:" + "ab" * 32


def test_fresh_cache_and_bitmap_round_trip(tmp_path: pathlib.Path) -> None:
    c = ChunkCache(tmp_path / "c")
    assert (tmp_path / "c" / "layout").read_text() == LAYOUT
    bits = bytes([0b1010_0101, 0b0000_0011])
    c.save_present(DIGEST, 10 * 4096, 4096, 10, bits)
    assert c.load_present(DIGEST, 10 * 4096, 4096, 10) == bits
    assert os.listdir(tmp_path / "c" / "tmp") == []
    # a bitmap for another shape of the layer is not believed
    assert c.load_present(DIGEST, 10 * 4096, 8192, 5) == bytes(1)
    assert c.load_present(DIGEST, 9 * 4096, 4096, 10) == bytes(2)
    # nor one that does not match its checksum
    raw = bytearray(pathlib.Path(c.present_path(DIGEST)).read_bytes())
    raw[-5] ^= 0x80
    pathlib.Path(c.present_path(DIGEST)).write_bytes(bytes(raw))
    assert c.load_present(DIGEST, 10 * 4096, 4096, 10) == bytes(2)
    with pytest.raises(ValueError):
        c.save_present(DIGEST, 10 * 4096, 4096, 10, bytes(3))
    with open(c.data_path(DIGEST), "wb") as f:
        f.truncate(1 << 30)
        f.write(b"x" * 8192)
    assert c.usage().layers == 1 and 8192 <= c.usage().bytes < 1 << 20  # holes are free
    assert c.drop_data(DIGEST) >= 8192
    assert not os.path.exists(c.present_path(DIGEST)) and c.usage().bytes == 0


def test_older_layout_is_discarded_not_misread(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "layout").write_text("layerfs-lazy-cache 1\n")
    (root / "chunks" / "de").mkdir(parents=True)
    (root / "chunks" / "de" / "deadbeef").write_bytes(b"old format")
    (root / "layers").mkdir()
    (root / "layers" / ("ab" * 32 + ".json")).write_text('{"slot": 0}')
    c = ChunkCache(root)
    assert (root / "layout").read_text() == LAYOUT
    assert not (root / "chunks").exists() and c.layers() == {}
    assert c.usage().layers == 0


def test_foreign_directory_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "precious.txt").write_text("not ours")
    with pytest.raises(StoreError, match="not a layerfs lazy cache"):
        ChunkCache(tmp_path / "c")
    assert (tmp_path / "c" / "precious.txt").read_text() == "not ours"


def _build(tmp_path: pathlib.Path) -> tuple[Store, str, bytes]:
    tree = make_tree(tmp_path / "tree")
    store = Store(tmp_path / "server-store", chunk_size=CHUNK)
    img = tmp_path / "layer.erofs"
    digest = build_layer(str(tree), kind="base", store=store, output=str(img),
                         chunk_size=CHUNK).manifest.digest
    return store, digest, img.read_bytes()


def _pread(path: str, size: int, off: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def _bit(bits: bytes, i: int) -> bool:
    return bool(bits[i >> 3] >> (i & 7) & 1)


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.mount
def test_restart_keeps_present_chunks_and_never_trusts_unmarked_bytes(
        tmp_path: pathlib.Path) -> None:
    store, digest, image = _build(tmp_path)
    m = store.manifest(digest)
    n = len(m.chunks)
    remote = RemoteThread(store)
    remote.start()
    cache = tmp_path / "cache"
    try:
        with lazy_node(cache) as c:
            f = c.register(digest, remote.url)["file"]
            for i in (0, 3, 5):
                assert _pread(f, 4096, i * CHUNK) == image[i * CHUNK:i * CHUNK + 4096]
        cc = ChunkCache(cache)
        bits = cc.load_present(digest, m.size, m.chunk_size, n)
        assert all(_bit(bits, i) for i in (0, 3, 5)) and not _bit(bits, 7)
        # a torn write of chunk 7 (never marked present) must not be served
        with open(cc.data_path(digest), "r+b") as fh:
            fh.seek(7 * CHUNK)
            fh.write(b"\xee" * (CHUNK // 2))
        gets = sum(remote.gets.values())
        with lazy_node(cache) as c:
            f = c.stats()["layers"][digest]["file"]
            for i in (0, 3, 5):
                assert _pread(f, 4096, i * CHUNK) == image[i * CHUNK:i * CHUNK + 4096]
            assert sum(remote.gets.values()) == gets  # served from the cache file
            assert _pread(f, CHUNK, 7 * CHUNK) == image[7 * CHUNK:8 * CHUNK]
            assert sum(remote.gets.values()) >= gets + 1
        # a bitmap that fails its checksum makes every chunk come again, right
        raw = bytearray(pathlib.Path(cc.present_path(digest)).read_bytes())
        raw[-1] ^= 1
        pathlib.Path(cc.present_path(digest)).write_bytes(bytes(raw))
        with open(cc.data_path(digest), "r+b") as fh:
            fh.seek(0)
            fh.write(b"\xee" * CHUNK)
        with lazy_node(cache) as c:
            f = c.stats()["layers"][digest]["file"]
            assert c.stats()["layers"][digest]["present_chunks"] == 0
            assert _pread(f, 4096, 0) == image[:4096]
    finally:
        remote.close()


@pytest.fixture
def small_tmpfs(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    mp = tmp_path / "tiny"
    mp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mp)], check=True)
    try:
        yield mp
    finally:
        umount(mp)


def _fill(fs: pathlib.Path) -> pathlib.Path:
    """Fill the filesystem at ``fs`` with a ballast file (returned) until ENOSPC."""
    ballast = fs / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as full:
            while True:
                os.write(fd, b"\1" * 4096)
    finally:
        os.close(fd)
    assert full.value.errno == errno.ENOSPC
    return ballast


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.mount
def test_disk_full_is_a_clear_error_and_marks_nothing(small_tmpfs: pathlib.Path,
                                                      tmp_path: pathlib.Path) -> None:
    store, digest, image = _build(tmp_path)
    m = store.manifest(digest)
    remote = RemoteThread(store)
    remote.start()
    cache = small_tmpfs / "c"
    try:
        with lazy_node(cache, fetch_timeout=2.0) as c:
            f = c.register(digest, remote.url)["file"]
            assert _pread(f, 4096, 0) == image[:4096]
            ballast = _fill(small_tmpfs)
            # a whole chunk does not fit even after evicting chunk 0
            with pytest.raises(OSError) as ei:
                _pread(f, 4096, 9 * CHUNK)
            assert ei.value.errno == errno.EIO
            st = c.stats()["layers"][digest]
            assert st["present_chunks"] == 0
            ballast.unlink()
            time.sleep(1.1)  # past the fail-fast hold
            assert _pread(f, 4096, 9 * CHUNK) == image[9 * CHUNK:9 * CHUNK + 4096]
        bits = ChunkCache(cache).load_present(digest, m.size, m.chunk_size, len(m.chunks))
        assert _bit(bits, 9)
        log = (cache / "server.log").read_text()
        assert f"layer {digest} chunk 9" in log and "disk full (ENOSPC)" in log
    finally:
        remote.close()


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.mount
def test_server_killed_on_a_full_disk_comes_back(small_tmpfs: pathlib.Path,
                                                 tmp_path: pathlib.Path) -> None:
    # Review finding: a restarted server could not save its slot mark on a full disk and
    # crash-looped; the supervisor then died on its own log write and detached the FUSE
    # mount, taking every lazy mount of the node with it.
    import signal

    store, digest, image = _build(tmp_path)
    remote = RemoteThread(store)
    remote.start()
    cache = small_tmpfs / "c"
    try:
        with lazy_node(cache, fetch_timeout=2.0) as c:
            f = c.register(digest, remote.url)["file"]
            assert _pread(f, 4096, 0) == image[:4096]
            (cache / "slots.json").unlink()  # so that the restart must write it again
            ballast = _fill(small_tmpfs)
            first = c.server_pid()
            assert first is not None
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while not (c.server_pid() not in (None, first) and c.alive()):
                assert time.monotonic() < deadline, (cache / "server.log").read_text()[-800:]
                time.sleep(0.05)
            assert _pread(f, 4096, 0) == image[:4096]  # the mount survived, still served
            ballast.unlink()
    finally:
        remote.close()


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.mount
def test_cache_limit_evicts_and_reads_stay_right(tmp_path: pathlib.Path) -> None:
    tree = make_tree(tmp_path / "tree")
    store = Store(tmp_path / "server-store", chunk_size=CHUNK)
    img = tmp_path / "layer.erofs"
    digest = build_layer(str(tree), kind="base", store=store, output=str(img),
                         chunk_size=CHUNK).manifest.digest
    image = img.read_bytes()
    remote = RemoteThread(store)
    remote.start()
    limit = 16 * CHUNK
    try:
        with lazy_node(tmp_path / "cache", cache_limit=limit) as c:
            info = c.register(digest, remote.url)
            fd = os.open(info["file"], os.O_RDONLY)
            try:
                for off in range(0, len(image), CHUNK):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    assert os.pread(fd, 4096, off) == image[off:off + 4096]
            finally:
                os.close(fd)
            st = c.stats()
            assert st["cache"]["bytes"] <= limit + CHUNK
            assert ChunkCache(c.cache).usage().bytes <= limit + CHUNK
            # evicted chunks come back on demand, verified
            fd = os.open(info["file"], os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, 4096, 0) == image[:4096]
            finally:
                os.close(fd)
    finally:
        remote.close()


def test_metrics_of_a_server_that_is_not_running(tmp_path: pathlib.Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from layerfs.lazy.client import LazyClient
    from layerfs.lazy.metrics import LazyCollector

    reg = CollectorRegistry()
    reg.register(LazyCollector(LazyClient(str(tmp_path / "nothing"))))
    assert "layerfs_lazy_up 0.0" in generate_latest(reg).decode()


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.mount
def test_start_while_the_server_restarts_makes_no_second_supervisor(
        tmp_path: pathlib.Path) -> None:
    import signal

    from layerfs.lazy import client

    cache = tmp_path / "cache"
    with lazy_node(cache) as c:
        first = int((cache / "supervisor.pid").read_text())
        pid = c.server_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the supervisor restarts it within a second
        assert client.start(str(cache)) is None  # waited for it, started nothing
        assert c.alive() and c.server_pid() != pid
        assert int((cache / "supervisor.pid").read_text()) == first
        with open("/proc/mounts") as f:
            assert f.read().count(str(cache / "fuse") + " ") == 1


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.mount
def test_a_read_spanning_more_than_the_cache_limit_completes(tmp_path: pathlib.Path) -> None:
    # Review finding: with a limit of 3 chunks, a 16-chunk read never finished: each
    # arriving chunk evicted the ones it had already waited for (24k fetches in 30 s).
    import mmap

    store, digest, image = _build(tmp_path)
    remote = RemoteThread(store)
    remote.start()
    span = 16 * CHUNK
    try:
        with lazy_node(tmp_path / "cache", cache_limit=3 * CHUNK, fetch_timeout=10) as c:
            info = c.register(digest, remote.url)
            fd = os.open(info["file"], os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, span)
            try:
                assert os.preadv(fd, [buf], 0) == span
            finally:
                os.close(fd)
            assert buf[:span] == image[:span]
            buf.close()
            st = c.stats()["layers"][digest]
            assert st["chunks_fetched"] <= 16 + 2, st  # each once (and one speculative)
            # the limit holds again once the read is answered
            assert c.stats()["cache"]["bytes"] <= 3 * CHUNK + CHUNK
    finally:
        remote.close()
