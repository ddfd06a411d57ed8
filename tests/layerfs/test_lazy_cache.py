"""The node cache: versioned layout, atomic chunk files, size limit with eviction, disk
full."""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

import pytest

from layerfs.build import build_layer
from layerfs.errors import StoreError
from layerfs.lazy.cache import LAYOUT, CacheFullError, ChunkCache
from layerfs.mount import umount
from layerfs.store import Store
from tests.layerfs.lazy_helpers import CHUNK, RemoteThread, lazy_node, make_tree


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_fresh_cache_and_chunk_round_trip(tmp_path: pathlib.Path) -> None:
    c = ChunkCache(tmp_path / "c")
    assert (tmp_path / "c" / "layout").read_text() == LAYOUT
    data = b"abc" * 1000
    d = _digest(data)
    assert not c.has(d)
    path = c.put(d, data)
    assert pathlib.Path(path).read_bytes() == data and c.has(d)
    assert c.usage().bytes == len(data)
    assert os.listdir(tmp_path / "c" / "tmp") == []
    assert c.remove(d) == len(data) and not c.has(d)


def test_older_layout_is_discarded_not_misread(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "layout").write_text("layerfs-lazy-cache 0\n")
    (root / "chunks").mkdir()
    (root / "chunks" / "deadbeef").write_bytes(b"old format")
    (root / "index.db").write_bytes(b"old")
    c = ChunkCache(root)
    assert (root / "layout").read_text() == LAYOUT
    assert not (root / "index.db").exists()
    assert c.usage().chunks == 0


def test_foreign_directory_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "precious.txt").write_text("not ours")
    with pytest.raises(StoreError, match="not a layerfs lazy cache"):
        ChunkCache(tmp_path / "c")
    assert (tmp_path / "c" / "precious.txt").read_text() == "not ours"


@pytest.fixture
def small_tmpfs(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    mp = tmp_path / "tiny"
    mp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mp)], check=True)
    try:
        yield mp
    finally:
        umount(mp)


@pytest.mark.root
@pytest.mark.mount
def test_disk_full_is_a_clear_error_and_leaves_nothing(small_tmpfs: pathlib.Path) -> None:
    c = ChunkCache(small_tmpfs / "c")
    data = os.urandom(512 << 10)
    with pytest.raises(CacheFullError, match="disk full") as ei:
        c.put(_digest(data), data)
    assert ei.value.errno == errno.ENOSPC
    assert not c.has(_digest(data))
    assert os.listdir(small_tmpfs / "c" / "tmp") == []


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
