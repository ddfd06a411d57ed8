"""The node's swap (edged.node.swap): a zram device of our own, set up at need, adopted or
removed after a crash, gone after stop; the host's devices (zram0) never touched."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edged.errors import BackendError
from edged.node import swap as swapmod
from edged.node.swap import SwapManager, active_swaps, header_label, swap_header

MiB = 1 << 20
ZRAM = Path("/sys/class/zram-control")
needs_zram = pytest.mark.skipif(not ZRAM.exists(), reason="needs zram (hot_add) in the kernel")


def test_swap_header_round_trip() -> None:
    page = swap_header(64 * MiB, "edged-0123456789")
    assert len(page) == 4096 and page[-10:] == b"SWAPSPACE2"
    assert header_label(page) == "edged-0123456789"
    assert header_label(b"\0" * 4096) is None
    with pytest.raises(ValueError):
        swap_header(16 * 4096, "x" * 17)
    with pytest.raises(ValueError):
        swap_header(8 * 4096, "small")


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="swap mode"):
        SwapManager(Path("/nonexistent"), mode="disk")


def _zram_snapshot() -> dict[str, str]:
    """What the host's zram0 looks like (it is never ours to change)."""
    z = Path("/sys/block/zram0")
    if not z.exists():
        return {}
    return {f: (z / f).read_text() for f in ("disksize", "comp_algorithm")}


def _devices() -> set[str]:
    return {d for d in os.listdir("/sys/block") if d.startswith("zram")}


def _ours(path: str) -> bool:
    return any(os.path.realpath(a.path) == os.path.realpath(path) for a in active_swaps())


@pytest.mark.root
@needs_zram
def test_zram_set_up_lazily_and_removed_at_stop(tmp_path: Path) -> None:
    zram0, before = _zram_snapshot(), _devices()
    m = SwapManager(tmp_path, mode="zram", zram_bytes=64 * MiB, zram_mem_limit_bytes=32 * MiB)
    assert m.start()["zram_device"] is None  # nothing until reclaim needs it
    assert _devices() == before
    try:
        assert m.ensure()
        assert m.zram is not None
        dev = f"/dev/zram{m.zram}"
        assert _ours(dev) and f"zram{m.zram}" in _devices()
        area = next(a for a in active_swaps() if os.path.realpath(a.path) == dev)
        assert area.priority == swapmod.ZRAM_PRIORITY and area.size_bytes > 60 * MiB
        assert json.loads((tmp_path / "swap.json").read_text())["zram"] == m.zram
        z = m.zram_stats()
        assert z is not None and z["mem_limit_bytes"] == 32 * MiB
        assert m.features()["zram_algorithm"] == "lzo-rle"
        assert m.ensure() and m.zram == int(dev.removeprefix("/dev/zram"))  # idempotent
    finally:
        m.stop()
    assert _devices() == before and not (tmp_path / "swap.json").exists()
    assert not _ours(dev)
    assert _zram_snapshot() == zram0


@pytest.mark.root
@needs_zram
def test_crash_leftovers_adopted_or_removed(tmp_path: Path) -> None:
    before = _devices()
    a = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB)
    a.start(set_up=True)
    n = a.zram
    assert n is not None
    # the daemon dies: a new one adopts the device (sandboxes kept may have pages in it)
    b = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB)
    try:
        feats = b.start()
        assert feats["adopted"] and b.zram == n and b.ensure() and b.zram == n
    finally:
        b.stop()
    assert _devices() == before
    # a device hot-added but never configured when the daemon died: removed at next start
    m = int((ZRAM / "hot_add").read_text())
    (tmp_path / "swap.json").write_text(json.dumps({"zram": m, "file": None}))
    c = SwapManager(tmp_path, mode="off")
    c.start()
    assert f"zram{m}" not in _devices() and c.zram is None
    assert not (tmp_path / "swap.json").exists()
    c.stop()
    assert _devices() == before


@pytest.mark.root
@needs_zram
def test_refused_algorithm_leaves_nothing(tmp_path: Path) -> None:
    before = _devices()
    # no swap on the host as far as this manager knows: a swap area left active by something
    # else (another daemon's zram) must not make ensure() true (CI failed on that)
    empty = tmp_path / "swaps"
    empty.write_text("Filename\tType\tSize\tUsed\tPriority\n")
    m = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB, algorithm="no-such-algo",
                    proc_swaps=str(empty))
    m.start()
    assert not m.ensure()  # logged, reclaim goes on without
    assert _devices() == before and m.zram is None
    m.stop()
    assert not (tmp_path / "swap.json").exists()


def test_host_swap_is_used_not_replaced(tmp_path: Path) -> None:
    fake = tmp_path / "swaps"
    fake.write_text("Filename\tType\tSize\tUsed\tPriority\n"
                    "/dev/sdz2                               partition\t1048572\t512\t-2\n")
    m = SwapManager(tmp_path, mode="auto", zram_bytes=32 * MiB, proc_swaps=str(fake))
    feats = m.start()
    assert not m.wanted and feats["host_swap"] == ["/dev/sdz2"]
    assert m.ensure()  # the host's swap is there to page into
    assert m.zram is None and m.usage() == {"total_bytes": 1048572 * 1024,
                                            "used_bytes": 512 * 1024}


@pytest.mark.root
def test_swap_file_behind_zram(tmp_path: Path) -> None:
    m = SwapManager(tmp_path, mode="zram", zram_bytes=0, file_bytes=32 * MiB)
    m.start()
    try:
        assert m.ensure() and m.file is not None
        area = next(a for a in active_swaps()
                    if os.path.realpath(a.path) == os.path.realpath(m.file))
        assert area.priority == swapmod.FILE_PRIORITY
        assert (m.file.stat().st_mode & 0o777) == 0o600
    finally:
        path = m.file
        m.stop()
    assert path is not None and not path.exists() and not _ours(str(path))


def test_unusable_hot_add_is_a_backend_error(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    (sysfs / "class/zram-control").mkdir(parents=True)
    m = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB, sys=sysfs)
    with pytest.raises(BackendError, match="hot_add"):
        m._add_zram()
