"""Lazy layer loading end to end: a layer pushed to a chunk server on loopback, exposed by
the lazy FUSE server on a node with an empty cache, mounted by the kernel."""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zstandard

from layerfs.build import build_layer
from layerfs.lazy.client import LazyClient
from layerfs.mount import mounted_erofs
from layerfs.store import Store
from tests.layerfs.lazy_helpers import (
    CHUNK,
    RemoteThread,
    lazy_node,
    make_tree,
    mounted,
    snapshot,
)

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.mount]


@dataclass
class Layer:
    store: Store
    digest: str
    image: pathlib.Path
    tree: pathlib.Path
    remote: RemoteThread


@pytest.fixture
def layer(tmp_path: pathlib.Path) -> Iterator[Layer]:
    tree = make_tree(tmp_path / "tree")
    store = Store(tmp_path / "server-store", chunk_size=CHUNK)
    img = tmp_path / "layer.erofs"
    res = build_layer(str(tree), kind="base", store=store, output=str(img), chunk_size=CHUNK)
    remote = RemoteThread(store)
    remote.start()
    try:
        yield Layer(store, res.manifest.digest, img, tree, remote)
    finally:
        remote.close()


def _file(c: LazyClient, digest: str) -> str:
    return os.path.join(c.cache, "fuse", digest[7:] + ".erofs")


def _read(path: str | pathlib.Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _stats(c: LazyClient, digest: str) -> dict[str, object]:
    return dict(c.stats()["layers"][digest])


def test_lazy_mount_equals_image_and_fetches_little(layer: Layer,
                                                    tmp_path: pathlib.Path) -> None:
    with lazy_node(tmp_path / "cache") as c:
        info = c.register(layer.digest, layer.remote.url)
        assert info["size"] == layer.image.stat().st_size
        assert os.listdir(os.path.join(c.cache, "fuse")) == [layer.digest[7:] + ".erofs"]
        with mounted(info["file"], tmp_path / "lazy") as mp:
            assert _read(os.path.join(mp, "etc/hostname")) == b"node\n"
            assert _read(os.path.join(mp, "lib/mod007.py")).startswith(b"# module 7")
            st = _stats(c, layer.digest)
            size = layer.image.stat().st_size
            assert 0 < int(st["bytes_fetched"]) <= 0.2 * size, st  # type: ignore[call-overload]
            with mounted_erofs(layer.image) as direct:
                assert snapshot(mp) == snapshot(direct)
            st = _stats(c, layer.digest)
            # reading everything fetched every chunk exactly once
            assert st["bytes_fetched"] == size
            assert st["chunks_fetched"] == st["chunks"] == len(layer.remote.gets)
            assert max(layer.remote.gets.values()) == 1


def test_concurrent_readers_of_a_missing_chunk_fetch_it_once(layer: Layer,
                                                             tmp_path: pathlib.Path) -> None:
    layer.remote.delay = 0.5  # every reader arrives while the fetch is in flight
    with lazy_node(tmp_path / "cache") as c:
        c.register(layer.digest, layer.remote.url)
        path = _file(c, layer.digest)
        m = layer.store.manifest(layer.digest)
        idx = 40
        want = layer.image.read_bytes()[idx * CHUNK:(idx + 1) * CHUNK]
        results: dict[int, bytes] = {}

        def reader(k: int) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                off = idx * CHUNK + k * 4096
                results[k] = os.pread(fd, 4096, off)
            finally:
                os.close(fd)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(0, 16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(results[k] == want[k * 4096:(k + 1) * 4096] for k in range(16))
        assert layer.remote.gets[m.chunks[idx].digest] == 1
        # kernel readahead may pull the next chunk too; each chunk is fetched once
        assert max(layer.remote.gets.values()) == 1
        deadline = time.monotonic() + 10
        while (st := _stats(c, layer.digest))["inflight"] and time.monotonic() < deadline:
            time.sleep(0.05)  # a readahead fetch may still be in flight
        # one fetch per chunk, whether a read or a sequential miss's speculation queued it
        assert st["queued"] + st["speculative"] == st["chunks_fetched"] == \
            len(layer.remote.gets)


def _settle(c: LazyClient, digest: str) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while (st := _stats(c, digest))["inflight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return st


@pytest.mark.parametrize("ahead", [1, 0])
def test_a_sequential_miss_fetches_the_next_chunk_ahead(layer: Layer, tmp_path: pathlib.Path,
                                                        ahead: int) -> None:
    with lazy_node(tmp_path / "cache", speculate=ahead) as c:
        c.register(layer.digest, layer.remote.url)
        image = layer.image.read_bytes()
        fd = os.open(_file(c, layer.digest), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel readahead

            def read(idx: int) -> None:
                assert os.pread(fd, 4096, idx * CHUNK) == image[idx * CHUNK:idx * CHUNK + 4096]

            read(20)  # chunk 19 missing: a random read, nothing ahead
            st = _settle(c, layer.digest)
            assert (st["chunks_fetched"], st["speculative"]) == (1, 0)
            read(21)  # chunk 20 present: sequential, chunk 22 comes ahead
            st = _settle(c, layer.digest)
            assert (st["chunks_fetched"], st["speculative"]) == (2 + ahead, ahead)
            assert st["present_chunks"] == 2 + ahead
            read(22)
            st = _settle(c, layer.digest)
            # a hit if it came ahead (and 23 does not come: a hit speculates nothing)
            assert (st["misses"], st["chunks_fetched"]) == ((2, 3) if ahead else (3, 3))
            read(40)  # random again
            st = _settle(c, layer.digest)
            assert st["speculative"] == ahead
            assert st["queued"] + st["speculative"] == st["chunks_fetched"] == \
                sum(layer.remote.gets.values())
        finally:
            os.close(fd)


def _corrupt(store: Store, digest: str) -> bytes:
    path = os.path.join(store.root, "chunks", digest[7:9], digest[7:])
    good = _read(path)
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(b"\xee" * CHUNK))
    return good


def test_corrupt_chunk_is_detected_and_never_served(layer: Layer,
                                                    tmp_path: pathlib.Path) -> None:
    m = layer.store.manifest(layer.digest)
    idx = 30
    cdig = m.chunks[idx].digest
    good = _corrupt(layer.store, cdig)
    with lazy_node(tmp_path / "cache", fetch_timeout=1.5, attempt_timeout=1.0) as c:
        c.register(layer.digest, layer.remote.url)
        fd = os.open(_file(c, layer.digest), os.O_RDONLY)
        try:
            with pytest.raises(OSError) as ei:
                os.pread(fd, 4096, idx * CHUNK)
            assert ei.value.errno == errno.EIO
            st = _stats(c, layer.digest)
            assert int(st["corrupt"]) >= 2 and st["present_chunks"] == 0  # type: ignore[call-overload]
            data_file = os.path.join(c.cache, "data", layer.digest[7:] + ".img")
            with open(data_file, "rb") as f:
                f.seek(idx * CHUNK)
                assert b"\xee" not in f.read(CHUNK)  # the bad bytes never reached the cache
            # the remote is repaired: the next read (after the 1 s fail-fast hold) fetches
            # again and gets the right bytes
            path = os.path.join(layer.store.root, "chunks", cdig[7:9], cdig[7:])
            with open(path, "wb") as f:
                f.write(good)
            time.sleep(1.0)
            want = layer.image.read_bytes()[idx * CHUNK:idx * CHUNK + 4096]
            assert os.pread(fd, 4096, idx * CHUNK) == want
        finally:
            os.close(fd)
        log = _read(os.path.join(c.cache, "server.log")).decode()
        assert f"chunk {idx} ({cdig})" in log and "does not match its digest" in log


def test_remote_gone_gives_eio_within_the_bound(layer: Layer, tmp_path: pathlib.Path) -> None:
    bound = 2.0
    with lazy_node(tmp_path / "cache", fetch_timeout=bound, attempt_timeout=0.5) as c:
        c.register(layer.digest, layer.remote.url)
        layer.remote.stop()
        fd = os.open(_file(c, layer.digest), os.O_RDONLY)
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as ei:
                os.pread(fd, 4096, 10 * CHUNK)
            spent = time.monotonic() - t0
            assert ei.value.errno == errno.EIO
            assert bound * 0.8 <= spent <= bound + 2.0, spent
            # the remote comes back: reads work again (after the 1 s fail-fast hold)
            layer.remote.start()
            time.sleep(1.0)
            want = layer.image.read_bytes()[10 * CHUNK:10 * CHUNK + 4096]
            assert os.pread(fd, 4096, 10 * CHUNK) == want
        finally:
            os.close(fd)
        log = _read(os.path.join(c.cache, "server.log")).decode()
        m = layer.store.manifest(layer.digest)
        assert (f"layer {layer.digest} chunk 10 ({m.chunks[10].digest}) from remote "
                f"{layer.remote.url}: gave up") in log


def test_server_killed_mid_read_recovers(layer: Layer, tmp_path: pathlib.Path) -> None:
    layer.remote.delay = 1.5
    image = layer.image.read_bytes()
    with lazy_node(tmp_path / "cache", fetch_timeout=20) as c:
        c.register(layer.digest, layer.remote.url)
        with mounted(_file(c, layer.digest), tmp_path / "lazy") as mp:
            first = c.server_pid()
            got: dict[str, object] = {}

            def read() -> None:
                try:
                    got["data"] = _read(os.path.join(mp, "bin/tool3"))
                except OSError as exc:
                    got["error"] = exc

            t = threading.Thread(target=read)
            t.start()
            time.sleep(0.7)  # the read waits on the slow remote
            assert first is not None and t.is_alive()
            os.kill(first, signal.SIGKILL)
            layer.remote.delay = 0
            t.join(60)
            assert not t.is_alive()
            # Linux 6.9+ requeues the dead server's requests (FUSE_NOTIFY_RESEND): the read
            # completes; before that it may fail cleanly, never hang.
            kernel = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
            if kernel >= (6, 9) or "data" in got:
                assert got["data"] == (layer.tree / "bin/tool3").read_bytes()
            else:
                assert isinstance(got["error"], OSError)
            second = c.server_pid()
            assert second is not None and second != first
            assert c.stats()["resumed"] is True
            # the existing mount keeps working: the whole tree reads back right
            with mounted_erofs(layer.image) as direct:
                assert snapshot(mp) == snapshot(direct)
            slots = c.stats()["slots"]
            assert slots["live"] == 1 and slots["pinned"] == 0, slots
        # The kernel's lookups of the layer's inode were counted by the dead server, so
        # the slot is pinned until the kernel forgets the inode: here, once unmounted
        # and unregistered (then it is free again; see also the test of a held file).
        slot = c.stats()["layers"][layer.digest]["slot"]
        c.unregister(layer.digest)
        assert _wait_slots(c, pinned=0, reusable=1)["reusable"] == 1
        other = tmp_path / "other"
        other.mkdir()
        (other / "f").write_text("other\n")
        res = build_layer(str(other), kind="workspace", store=layer.store, chunk_size=CHUNK)
        b = c.register(res.manifest.digest, layer.remote.url)
        assert b["slot"] == slot
        with mounted(b["file"], tmp_path / "b") as mp:
            assert _read(os.path.join(mp, "f")) == b"other\n"
        assert len(image) == layer.image.stat().st_size


def test_prometheus_metrics(layer: Layer, tmp_path: pathlib.Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from layerfs.lazy.metrics import LazyCollector

    with lazy_node(tmp_path / "cache") as c:
        c.register(layer.digest, layer.remote.url)
        fd = os.open(_file(c, layer.digest), os.O_RDONLY)
        try:
            os.pread(fd, 4096, 0)
        finally:
            os.close(fd)
        reg = CollectorRegistry()
        reg.register(LazyCollector(c))
        text = generate_latest(reg).decode()
        lab = f'{{layer="{layer.digest}"}}'
        assert "layerfs_lazy_up 1.0" in text
        assert f"layerfs_lazy_reads_total{lab} 1.0" in text
        size = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(f"layerfs_lazy_layer_bytes{lab}"))
        assert size == layer.image.stat().st_size
        assert f'layerfs_lazy_fetch_seconds_count{lab}' in text


def _wait_slots(c: LazyClient, **want: int) -> dict[str, int]:
    # the kernel's FORGETs after an unmount: 10 s ran out at load 36
    deadline = time.monotonic() + 60
    while True:
        slots = dict(c.stats()["slots"])
        if all(slots[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            return slots
        time.sleep(0.02)


def test_an_unregistered_layers_slot_is_reused_once_the_kernel_forgets_it(
        layer: Layer, tmp_path: pathlib.Path) -> None:
    # Bug: a removed layer's slot (its inode number) was never reused, so a node that
    # registered 4096 layers over its life could register no more.
    other = tmp_path / "other"
    (other / "etc").mkdir(parents=True)
    (other / "etc" / "hostname").write_text("other\n")
    res = build_layer(str(other), kind="workspace", store=layer.store,
                      output=str(tmp_path / "other.erofs"), chunk_size=CHUNK)
    with lazy_node(tmp_path / "cache") as c:
        a = c.register(layer.digest, layer.remote.url)
        with mounted(a["file"], tmp_path / "a") as mp:
            assert _read(os.path.join(mp, "etc/hostname")) == b"node\n"
            held = open(a["file"], "rb")  # noqa: SIM115 - held across the unregister
            c.unregister(layer.digest)
            assert os.listdir(os.path.join(c.cache, "fuse")) == []
            # Mounted and open: the kernel still has the inode, the slot is not reused.
            assert _wait_slots(c, held=1)["held"] == 1
            b = c.register(res.manifest.digest, layer.remote.url)
            assert b["slot"] != a["slot"]
            assert held.read(4096) == layer.image.read_bytes()[:4096]  # still served
            held.close()
        slots = _wait_slots(c, held=0, reusable=1)
        assert slots == {"live": 1, "held": 0, "reusable": 1, "pinned": 0,
                         "max": slots["max"]}, slots
        c.unregister(res.manifest.digest)
        assert _wait_slots(c, reusable=2)["reusable"] == 2
        # A new registration takes the lowest free slot, A's old one, and reads are of
        # the new layer (the kernel holds nothing of the old inode).
        again = c.register(res.manifest.digest, layer.remote.url)
        assert again["slot"] == a["slot"]
        with mounted(again["file"], tmp_path / "b") as mp:
            assert _read(os.path.join(mp, "etc/hostname")) == b"other\n"
        assert _read(again["file"]) == (tmp_path / "other.erofs").read_bytes()
        a2 = c.register(layer.digest, layer.remote.url)
        assert a2["slot"] == b["slot"]
        assert _read(a2["file"]) == layer.image.read_bytes()


def test_unregister_while_a_read_waits_fails_it_and_leaves_no_stale_fetch(
        layer: Layer, tmp_path: pathlib.Path) -> None:
    layer.remote.delay = 1.0
    other = tmp_path / "other"
    other.mkdir()
    (other / "f").write_text("other\n")
    res = build_layer(str(other), kind="workspace", store=layer.store, chunk_size=CHUNK)
    with lazy_node(tmp_path / "cache", fetch_timeout=20) as c:
        info = c.register(layer.digest, layer.remote.url)
        got: dict[str, object] = {}

        def read() -> None:
            try:
                with open(info["file"], "rb") as f:
                    f.seek(3 << 20)
                    got["data"] = f.read(4096)
            except OSError as exc:
                got["error"] = exc

        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.3)  # parked on the slow remote
        assert t.is_alive()
        c.unregister(layer.digest)
        t.join(10)
        assert not t.is_alive() and isinstance(got.get("error"), OSError), got
        assert got["error"].errno == errno.EIO  # type: ignore[attr-defined]
        layer.remote.delay = 0
        # the slot comes back once the kernel forgets the file; the old layer's fetch
        # (still in flight when it was removed) must not land in the new one
        assert _wait_slots(c, held=0, reusable=1)["reusable"] == 1
        b = c.register(res.manifest.digest, layer.remote.url)
        assert b["slot"] == info["slot"]
        time.sleep(1.2)  # the old fetch completes meanwhile
        with mounted(b["file"], tmp_path / "b") as mp:
            assert _read(os.path.join(mp, "f")) == b"other\n"
        st = _stats(c, res.manifest.digest)
        assert st["errors"] == 0 and st["corrupt"] == 0, st
        assert c.alive()


def _wait_restarted(c: LazyClient, old_pid: int) -> None:
    """Wait until the supervisor's new server (not ``old_pid``) answers."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if c.server_pid() not in (None, old_pid) and c.alive():
            return
        time.sleep(0.05)
    raise AssertionError("the lazy server did not come back")


def _other_layer(layer: Layer, tmp_path: pathlib.Path, name: str = "other",
                 size: int = 0) -> tuple[str, bytes]:
    """A second layer in the same store: (digest, image bytes)."""
    root = tmp_path / name
    root.mkdir()
    (root / "f").write_bytes(b"%s\n" % name.encode() + os.urandom(size))
    out = tmp_path / f"{name}.erofs"
    res = build_layer(str(root), kind="workspace", store=layer.store, output=str(out),
                      chunk_size=CHUNK)
    return res.manifest.digest, out.read_bytes()


def test_a_failed_registration_leaves_nothing_that_breaks_a_restart(
        layer: Layer, tmp_path: pathlib.Path) -> None:
    # Review finding: a registration failing after its record was saved left a record
    # claiming a slot the next registration took too; every restart then died on it.
    other, other_bytes = _other_layer(layer, tmp_path)
    with lazy_node(tmp_path / "cache") as c:
        bad = os.path.join(c.cache, "data", layer.digest[7:] + ".img")
        os.mkdir(bad)  # the cache file cannot be opened
        with pytest.raises(Exception, match="layer"):
            c.register(layer.digest, layer.remote.url)
        os.rmdir(bad)
        assert not os.path.exists(os.path.join(c.cache, "layers",
                                               layer.digest[7:] + ".json"))
        b = c.register(other, layer.remote.url)
        first = c.server_pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _wait_restarted(c, first)
        assert c.alive() and c.stats()["layers"][other]["slot"] == b["slot"]
        assert _read(b["file"]) == other_bytes
        a = c.register(layer.digest, layer.remote.url)
        assert a["slot"] != b["slot"] and _read(a["file"]) == layer.image.read_bytes()


def test_cache_accounting_survives_unregister_cycles(layer: Layer,
                                                     tmp_path: pathlib.Path) -> None:
    # Review finding: unregister counted a layer's present chunks after C had forgotten
    # them, so each cycle added the layer's bytes again; with a cache limit every write
    # then evicted everything and a read of another layer never finished.
    size = layer.image.stat().st_size
    other, other_bytes = _other_layer(layer, tmp_path, size=2 << 20)
    with lazy_node(tmp_path / "cache", cache_limit=3 * size) as c:
        for _ in range(4):
            info = c.register(layer.digest, layer.remote.url)
            assert _read(info["file"]) == layer.image.read_bytes()
            c.unregister(layer.digest)
            assert c.stats()["cache"]["bytes"] <= size + CHUNK
        fetched0 = sum(layer.remote.gets.values())
        t0 = time.monotonic()
        b = c.register(other, layer.remote.url)
        assert _read(b["file"]) == other_bytes
        assert time.monotonic() - t0 < 20
        # each chunk of the other layer fetched once: no eviction of what was just fetched
        assert sum(layer.remote.gets.values()) - fetched0 == _stats(c, other)["chunks"]


def test_after_a_resumed_restart_no_slot_the_kernel_may_hold_is_reused(
        layer: Layer, tmp_path: pathlib.Path) -> None:
    # Review finding: a restarted server pinned only the slots its records named; a
    # layer registered again had moved to another slot, so its old slot, whose inode the
    # kernel still held (an open file), went to another layer: that file then read the
    # old layer's bytes, and the old file the new layer's.
    other, other_bytes = _other_layer(layer, tmp_path, size=len(layer.image.read_bytes()))
    with lazy_node(tmp_path / "cache") as c:
        a = c.register(layer.digest, layer.remote.url)
        held = open(a["file"], "rb")  # noqa: SIM115 - held across the restart
        try:
            assert held.read() == layer.image.read_bytes()
            c.unregister(layer.digest)
            a2 = c.register(layer.digest, layer.remote.url)
            assert a2["slot"] != a["slot"]  # the first is still held by the open file
            first = c.server_pid()
            assert first is not None
            os.kill(first, signal.SIGKILL)
            _wait_restarted(c, first)
            assert c.stats()["resumed"] is True
            b = c.register(other, layer.remote.url)
            assert b["slot"] not in (a["slot"], a2["slot"])
            assert _read(b["file"]) == other_bytes
            assert os.stat(b["file"]).st_ino == b["slot"] + 2 != a["slot"] + 2
            assert c.stats()["slots"]["pinned"] == 1  # the held one
        finally:
            held.close()
        # Closed: the kernel forgets the old inode and the slot is unpinned (review
        # finding: each restart pinned every slot for the connection's life).
        assert _wait_slots(c, pinned=0)["pinned"] == 0


def test_after_a_restart_slots_the_kernel_had_forgotten_are_free(
        layer: Layer, tmp_path: pathlib.Path) -> None:
    # Review finding: a resumed server pinned every slot below the mark, and one whose
    # inode the kernel had forgotten before the crash never got a FORGET to unpin it.
    other, other_bytes = _other_layer(layer, tmp_path)
    with lazy_node(tmp_path / "cache") as c:
        a = c.register(layer.digest, layer.remote.url)
        assert _read(a["file"]) == layer.image.read_bytes()  # looked up by the kernel
        c.unregister(layer.digest)
        assert _wait_slots(c, reusable=1)["reusable"] == 1  # and forgotten
        first = c.server_pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _wait_restarted(c, first)
        assert c.stats()["slots"]["pinned"] == 0
        b = c.register(other, layer.remote.url)
        assert b["slot"] == a["slot"] and _read(b["file"]) == other_bytes
