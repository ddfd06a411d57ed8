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
from tests.edged import zram

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


def _ours(path: str) -> bool:
    return any(os.path.realpath(a.path) == os.path.realpath(path) for a in active_swaps())


@pytest.mark.root
@needs_zram
def test_zram_set_up_lazily_and_removed_at_stop(tmp_path: Path) -> None:
    zram0 = _zram_snapshot()
    m = SwapManager(tmp_path, mode="zram", zram_bytes=64 * MiB, zram_mem_limit_bytes=32 * MiB)
    assert m.start()["zram_device"] is None  # nothing until reclaim needs it
    assert m.zram is None and not (tmp_path / "swap.json").exists()
    try:
        assert m.ensure()
        assert m.zram is not None
        dev, ident = f"/dev/zram{m.zram}", zram.identity(f"zram{m.zram}")
        assert _ours(dev) and ident is not None
        area = next(a for a in active_swaps() if os.path.realpath(a.path) == dev)
        assert area.priority == swapmod.ZRAM_PRIORITY and area.size_bytes > 60 * MiB
        assert json.loads((tmp_path / "swap.json").read_text())["zram"] == m.zram
        z = m.zram_stats()
        assert z is not None and z["mem_limit_bytes"] == 32 * MiB
        assert m.features()["zram_algorithm"] == "lzo-rle"
        assert m.ensure() and m.zram == int(dev.removeprefix("/dev/zram"))  # idempotent
    finally:
        m.stop()
    assert zram.gone(dev.removeprefix("/dev/"), ident) and not (tmp_path / "swap.json").exists()
    assert _zram_snapshot() == zram0


@pytest.mark.root
@needs_zram
def test_crash_leftovers_adopted_or_removed(tmp_path: Path) -> None:
    a = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB)
    a.start(set_up=True)
    n = a.zram
    assert n is not None
    ident = zram.identity(f"zram{n}")
    # the daemon dies: a new one adopts the device (sandboxes kept may have pages in it)
    b = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB)
    try:
        feats = b.start()
        assert feats["adopted"] and b.zram == n and b.ensure() and b.zram == n
    finally:
        b.stop()
    assert zram.gone(f"zram{n}", ident)
    # a device hot-added but never configured when the daemon died: removed at next start
    m = int((ZRAM / "hot_add").read_text())
    half = zram.identity(f"zram{m}")
    (tmp_path / "swap.json").write_text(json.dumps({"zram": m, "file": None}))
    c = SwapManager(tmp_path, mode="off")
    c.start()
    assert zram.gone(f"zram{m}", half) and c.zram is None
    assert not (tmp_path / "swap.json").exists()
    c.stop()


@pytest.mark.root
@needs_zram
def test_refused_algorithm_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no swap on the host as far as this manager knows: a swap area left active by something
    # else (another daemon's zram) must not make ensure() true (CI failed on that)
    empty = tmp_path / "swaps"
    empty.write_text("Filename\tType\tSize\tUsed\tPriority\n")
    m = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB, algorithm="no-such-algo",
                    proc_swaps=str(empty))
    m.start()
    removed: list[tuple[str, int | None]] = []  # the device it hot-added, as it removes it
    remove = m._remove_zram

    def spy(n: int) -> None:
        removed.append((f"zram{n}", zram.identity(f"zram{n}")))
        remove(n)

    monkeypatch.setattr(m, "_remove_zram", spy)
    assert not m.ensure()  # logged, reclaim goes on without
    assert len(removed) == 1 and zram.gone(*removed[0]) and m.zram is None
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
    use = m.usage()
    assert m.zram is None and (use["total_bytes"], use["used_bytes"], use["files_bytes"]) == (
        1048572 * 1024, 512 * 1024, 0)


def test_another_daemons_swap_is_not_the_hosts(tmp_path: Path) -> None:
    """In "auto" mode a swap area another edged daemon made (its label says so) is not the
    host's swap: that daemon removes it when it stops, so this one sets up its own."""
    other = tmp_path / "other.swap"
    other.write_bytes(swap_header(32 * MiB, "edged-0123456789"))
    host = tmp_path / "host.swap"
    host.write_bytes(swap_header(32 * MiB, "host"))
    fake = tmp_path / "swaps"
    fake.write_text("Filename\tType\tSize\tUsed\tPriority\n"
                    f"{other}  file\t32764\t0\t100\n")
    m = SwapManager(tmp_path / "a", mode="auto", zram_bytes=32 * MiB, proc_swaps=str(fake))
    assert m.start()["host_swap"] == [] and m.wanted
    fake.write_text(fake.read_text() + f"{host}  file\t32764\t0\t-2\n")
    m = SwapManager(tmp_path / "b", mode="auto", zram_bytes=32 * MiB, proc_swaps=str(fake))
    reads: list[str] = []
    label = m._label
    m._label = lambda path: reads.append(path) or label(path)  # type: ignore[method-assign]
    assert m.start()["host_swap"] == [str(host)] and not m.wanted
    # each area's header read once (an open device makes its owner's hot_remove fail)
    assert m.features()["host_swap"] == [str(host)] and m.features()["host_swap"] == [str(host)]
    assert sorted(reads) == sorted([str(other), str(host)]), reads


def _only_under(monkeypatch: pytest.MonkeyPatch, d: Path) -> None:
    """The manager sees only the swap areas under ``d`` (its own files): other helpers'
    daemons have swap active at the same time, which would be free swap to it."""
    real = swapmod.active_swaps
    monkeypatch.setattr(swapmod, "active_swaps", lambda path="/proc/swaps": [
        a for a in real(path) if os.path.realpath(a.path).startswith(f"{d}/")])


@pytest.mark.root
def test_swap_files_grow_as_swap_fills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a zram device (zram_bytes 0) the first ensure adds a file of one step; more
    come only once the free swap falls below half a step, never beyond file_bytes; stop
    removes them all."""
    _only_under(monkeypatch, tmp_path)
    fake = tmp_path / "swaps"
    real = "/proc/swaps"
    m = SwapManager(tmp_path, mode="zram", zram_bytes=0, file_bytes=40 * MiB,
                    file_step_bytes=16 * MiB, disk_reserve=0.0)
    m.start()
    try:
        assert m.ensure() and len(m.files) == 1
        f0 = m.files[0]
        area = next(a for a in active_swaps() if os.path.realpath(a.path) == str(f0))
        assert area.priority == swapmod.FILE_PRIORITY and area.size_bytes >= 15 * MiB
        assert (f0.stat().st_mode & 0o777) == 0o600
        assert json.loads((tmp_path / "swap.json").read_text())["files"] == [str(f0)]
        assert m.ensure() and len(m.files) == 1  # 16 MiB free: no need
        # the file nearly full (as /proc/swaps would say): one more step, then the rest
        m.proc_swaps = str(fake)
        full0 = _with_used(Path(real).read_text(), str(f0), area.size_bytes // 1024 - 100)
        fake.write_text(full0)
        m.ensure()
        assert len(m.files) == 2 and m._file_size(m.files[1]) == 16 * MiB
        m.proc_swaps = real
        m.ensure()
        assert len(m.files) == 2  # the new one is free
        m.proc_swaps = str(fake)
        now = _with_used(Path(real).read_text(), str(f0), area.size_bytes // 1024 - 100)
        fake.write_text(_with_used(now, str(m.files[1]), 16 * 1024 - 100))
        m.ensure()
        assert len(m.files) == 3 and m._file_size(m.files[2]) == 8 * MiB  # 40 in all
        m.ensure()
        assert len(m.files) == 3
        m.proc_swaps = real
        assert m.usage()["files_bytes"] >= 39 * MiB
    finally:
        m.proc_swaps = real
        paths = list(m.files)
        m.stop()
    assert paths and not any(p.exists() or _ours(str(p)) for p in paths)
    assert not (tmp_path / "swap.json").exists()


def _with_used(swaps: str, path: str, used_kib: int) -> str:
    """The text of ``/proc/swaps`` ``swaps`` with the area ``path`` showing ``used_kib`` in
    use."""
    out = []
    for line in swaps.splitlines():
        f = line.split()
        if f and os.path.realpath(f[0]) == os.path.realpath(path):
            f[3] = str(used_kib)
            line = "\t".join(f)
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.mark.root
def test_disk_reserve_bounds_swap_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _only_under(monkeypatch, tmp_path)
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    m = SwapManager(tmp_path, mode="zram", zram_bytes=0, file_bytes=1 << 50,
                    file_step_bytes=16 * MiB, disk_reserve=float(free - 4 * MiB))
    m.start()
    try:
        assert m._file_room() <= 4 * MiB
        assert not m.ensure() and m.files == []  # below 16 MiB of room: none added
    finally:
        m.stop()


def test_crashed_daemons_half_made_swap_file_removed(tmp_path: Path) -> None:
    half = tmp_path / "swapfile.0"
    half.write_bytes(b"\0" * 8192)  # made, never given its header
    foreign = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    foreign.write_bytes(b"\0" * 8192)
    (tmp_path / "swap.json").write_text(json.dumps(
        {"label": "x", "zram": None, "files": [str(half), str(foreign)]}))
    m = SwapManager(tmp_path, mode="off")
    m.start()
    assert not half.exists() and m.files == []
    assert foreign.exists()  # not in our state dir: never ours to remove
    foreign.unlink()
    assert not (tmp_path / "swap.json").exists()


def test_unusable_hot_add_is_a_backend_error(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    (sysfs / "class/zram-control").mkdir(parents=True)
    m = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB, sys=sysfs)
    with pytest.raises(BackendError, match="hot_add"):
        m._add_zram()


def test_room_by_tier(tmp_path: Path) -> None:
    """What swap can take now, compressed (our zram device within its RAM limit at the
    given compression, a host zram device by its slots) and plain (disk, and what our
    swap files may still grow by)."""
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    (sysfs / "block/zram5").mkdir(parents=True)
    # orig 100 MiB, compr 40, mem_used 40, mem_limit 60: 20 MiB of RAM left
    (sysfs / "block/zram5/mm_stat").write_text(
        f"{100 * MiB} {40 * MiB} {40 * MiB} {60 * MiB} {40 * MiB} 0 0 0 0\n")
    fake = tmp_path / "swaps"
    fake.write_text("Filename\tType\tSize\tUsed\tPriority\n"
                    f"{dev}/zram5  partition\t{512 * 1024}\t{100 * 1024}\t100\n"
                    f"/dev/zram7  partition\t{64 * 1024}\t0\t5\n"
                    f"/dev/sdz2  partition\t{32 * 1024}\t{8 * 1024}\t-2\n")
    m = SwapManager(tmp_path / "state", mode="zram", zram=5, sys=sysfs, dev=dev,
                    proc_swaps=str(fake))
    # ours: 412 MiB of slots, but 20 MiB of RAM at 2.5:1 is 50 MiB; the host's zram7 64
    assert m.room(2.5) == (50 * MiB + 64 * MiB, 24 * MiB)
    (tmp_path / "state").mkdir()
    m.file_bytes, m.disk_reserve = 100 * MiB, 0.0
    assert m.room(2.5) == (114 * MiB, 124 * MiB)  # the files may still grow by 100 MiB


def test_another_daemons_swap_is_not_free_swap(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Another edged daemon's zram device (its label says so) is not swap this node may
    count on (that daemon removes it at its stop): with ours full, a swap file is added
    however much room the other's has, and the other's is not part of the room."""
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    (sysfs / "block/zram5").mkdir(parents=True)
    (sysfs / "block/zram5/mm_stat").write_text(
        f"{64 * MiB} {20 * MiB} {20 * MiB} 0 {20 * MiB} 0 0 0 0\n")
    dev.mkdir()
    (dev / "zram5").write_bytes(swap_header(64 * MiB, "ours-not-read"))
    (dev / "zram9").write_bytes(swap_header(32 * MiB, "edged-0123456789"))  # another daemon's
    fake = tmp_path / "swaps"
    fake.write_text("Filename\tType\tSize\tUsed\tPriority\n"
                    f"{dev}/zram5  partition\t{64 * 1024}\t{64 * 1024}\t100\n"
                    f"{dev}/zram9  partition\t{1024 * 1024}\t0\t100\n")
    (tmp_path / "state").mkdir()
    m = SwapManager(tmp_path / "state", mode="zram", zram=5, sys=sysfs, dev=dev,
                    proc_swaps=str(fake), file_bytes=64 * MiB, file_step_bytes=16 * MiB,
                    disk_reserve=0.0)
    added: list[int] = []
    monkeypatch.setattr(m, "_add_file", lambda n: added.append(n) or tmp_path / "f")
    m._grow()
    assert added == [16 * MiB]
    assert m.room(2.5) == (0, 64 * MiB)  # our zram full; the files may grow by 64 MiB
    assert [a.path for a in m.areas()] == [f"{dev}/zram5"]
