"""The node layer manager: layers mounted once, refcounted, reaped when idle; sandbox
overlay roots with a disk limit."""

from __future__ import annotations

import errno
import os
import pathlib
import time
from collections.abc import Iterator

import pytest

from layerfs.build import build_layer
from layerfs.manager import LayerManager
from layerfs.store import Store
from tests.layerfs.lazy_helpers import CHUNK, RemoteThread, make_tree

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.mount]


@pytest.fixture
def setup(tmp_path: pathlib.Path) -> Iterator[tuple[LayerManager, list[str], RemoteThread]]:
    store = Store(tmp_path / "server-store", chunk_size=CHUNK)
    base = make_tree(tmp_path / "base")
    tool = tmp_path / "toolkit"
    (tool / "etc").mkdir(parents=True)
    (tool / "etc" / "hostname").write_text("toolkit\n")  # shadows the base's
    (tool / "opt").mkdir()
    (tool / "opt" / "tool.sh").write_text("#!/bin/sh\necho hi\n")
    digests = [build_layer(str(p), kind=k, store=store, chunk_size=CHUNK).manifest.digest
               for p, k in ((base, "base"), (tool, "toolkit"))]
    remote = RemoteThread(store)
    remote.start()
    mgr = LayerManager(str(tmp_path / "cache"), remote.url, str(tmp_path / "layers"),
                       idle_seconds=3600)
    try:
        yield mgr, digests, remote
    finally:
        mgr.close()
        remote.close()
        mounts = pathlib.Path("/proc/mounts").read_text()
        assert str(tmp_path) not in mounts


def test_layers_mount_once_and_are_refcounted(
        setup: tuple[LayerManager, list[str], RemoteThread]) -> None:
    mgr, digests, _ = setup
    a = mgr.acquire(digests)
    b = mgr.acquire(digests[:1])
    assert b == a[:1]
    assert mgr.mounted() == {digests[0]: 2, digests[1]: 1}
    with open(os.path.join(a[0], "etc/hostname")) as f:
        assert f.read() == "node\n"
    mgr.release(digests)
    assert mgr.reap(0) == [digests[1]]  # still in use: the base stays
    assert sorted(mgr.client.stats()["layers"]) == sorted(digests)  # kept registered
    mgr.release(digests[:1])
    assert mgr.reap() == []  # idle, but not for an hour yet
    assert mgr.reap(0) == [digests[0]]
    assert mgr.mounted() == {}
    assert not os.path.ismount(a[0])


def test_uncounted_mount_and_unmount(
        setup: tuple[LayerManager, list[str], RemoteThread]) -> None:
    """For a caller that counts holders itself (edged's layer mounts): mount is idempotent
    and counts nothing, unmount is at once (its trace kept for the next mount) and leaves a
    layer this manager counts users of alone."""
    mgr, digests, _ = setup
    a = mgr.mount(digests[0])
    assert mgr.mount(digests[0]) == a and mgr.mounted() == {digests[0]: 0}
    with open(os.path.join(a, "etc/hostname")) as f:
        assert f.read() == "node\n"
    assert mgr.unmount(digests[0]) is True
    assert not os.path.ismount(a) and mgr.mounted() == {}
    assert mgr.unmount(digests[0]) is False  # not mounted
    mgr.acquire(digests[1:])
    assert mgr.unmount(digests[1]) is False and mgr.mounted() == {digests[1]: 1}
    mgr.release(digests[1:])
    assert mgr.reap(0) == [digests[1]]


def test_unmounted_layers_beyond_the_bound_are_unregistered(
        setup: tuple[LayerManager, list[str], RemoteThread]) -> None:
    # Bug: layers stayed registered with the lazy server forever, so a node running a
    # new workspace layer per task ran out of its layer slots.
    mgr, digests, _ = setup
    mgr.keep_registered = 1
    mgr.acquire(digests)
    mgr.release(digests)
    assert sorted(mgr.reap(0)) == sorted(digests)
    # the one unmounted last stays registered, the other is gone from the server
    assert list(mgr.client.stats()["layers"]) == [digests[-1]]
    (mp,) = mgr.acquire(digests[:1])  # registered again on demand
    with open(os.path.join(mp, "etc/hostname")) as f:
        assert f.read() == "node\n"
    assert sorted(mgr.client.stats()["layers"]) == sorted(digests)
    mgr.release(digests[:1])



def test_a_new_manager_trims_what_an_earlier_one_left_registered_but_not_what_is_mounted(
        setup: tuple[LayerManager, list[str], RemoteThread], tmp_path: pathlib.Path) -> None:
    # Review findings: layers an earlier manager kept registered were never unregistered
    # by the next one (a node restarting its daemon ran out of slots), and a layer that
    # someone else had mounted from the same cache was unregistered under them (EIO).
    from layerfs.mount import mounted_erofs

    mgr, digests, remote = setup
    mgr.acquire(digests)
    mgr.release(digests)
    assert sorted(mgr.reap(0)) == sorted(digests)
    assert sorted(mgr.client.stats()["layers"]) == sorted(digests)  # kept (256)
    # an operator's mount of the base, through a symlink to the cache with a space in it
    link = tmp_path / "the cache"
    link.symlink_to(mgr.client.cache)
    base_file = os.path.join(link, "fuse", digests[0][7:] + ".erofs")
    with mounted_erofs(base_file) as mp:
        later = LayerManager(mgr.client.cache, remote.url, str(tmp_path / "layers2"),
                             idle_seconds=3600, keep_registered=0)
        try:
            later.reap(0)  # nothing of its own: trims what it found at start
            assert list(later.client.stats()["layers"]) == [digests[0]]
            with open(os.path.join(mp, "etc/hostname")) as f:
                assert f.read() == "node\n"  # the operator's mount still reads
        finally:
            later.close()


def test_compose_overlay_root_with_disk_limit(
        setup: tuple[LayerManager, list[str], RemoteThread], tmp_path: pathlib.Path) -> None:
    mgr, digests, _ = setup
    r = mgr.compose("sbx-1", digests, str(tmp_path / "sandboxes"), disk_limit=1 << 20)
    try:
        with open(os.path.join(r.path, "etc/hostname")) as f:
            assert f.read() == "toolkit\n"  # the toolkit is above the base
        assert os.path.exists(os.path.join(r.path, "bin/tool0"))
        with open(os.path.join(r.path, "etc/new"), "w") as f:
            f.write("mine\n")
        assert os.path.exists(os.path.join(r.scratch, "upper/etc/new"))
        with pytest.raises(OSError) as ei, open(os.path.join(r.path, "big"), "wb") as f:
            f.write(b"\0" * (2 << 20))
            f.flush()
        assert ei.value.errno == errno.ENOSPC
        assert mgr.mounted() == {digests[0]: 1, digests[1]: 1}
    finally:
        mgr.decompose(r)
    assert not os.path.exists(r.path)
    assert mgr.mounted() == {digests[0]: 0, digests[1]: 0}


def test_release_records_trace_and_next_mount_prefetches(
        setup: tuple[LayerManager, list[str], RemoteThread]) -> None:
    mgr, digests, remote = setup
    (mp,) = mgr.acquire(digests[:1])
    with open(os.path.join(mp, "bin/tool2"), "rb") as f:
        f.read()
    mgr.release(digests[:1])
    trace = mgr.client.trace(digests[0])
    assert len(trace) >= 16  # tool2 is over 1 MiB in 64 KiB chunks
    saved = sorted(trace)
    # forget the cached chunks, remount: the trace is fetched before anyone reads
    mgr.reap(0)
    mgr.client.evict(0)
    remote.gets.clear()
    mgr.acquire(digests[:1])


    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = mgr.client.stats()["layers"][digests[0]]
        if st["present_chunks"] >= len(saved):
            break
        time.sleep(0.05)
    assert st["present_chunks"] >= len(saved)
    mgr.release(digests[:1])


def test_a_server_stopped_under_the_manager_is_started_again(
        setup: tuple[LayerManager, list[str], RemoteThread]) -> None:
    # Review finding: an operator's `layerfs umount` of the last mount of a shared cache
    # stops its lazy server, and the manager's next acquire failed for good.
    from layerfs.lazy import client

    mgr, digests, _ = setup
    mgr.acquire(digests[:1])
    mgr.release(digests[:1])
    mgr.reap(0)
    client.stop(mgr.client.cache)
    assert not mgr.client.alive()
    (mp,) = mgr.acquire(digests[:1])
    with open(os.path.join(mp, "etc/hostname")) as f:
        assert f.read() == "node\n"
    mgr.release(digests[:1])
