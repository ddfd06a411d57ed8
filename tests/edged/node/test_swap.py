"""The node's swap (edged.node.swap): a zram device of our own, set up at need, adopted or
removed after a crash, gone after stop; the host's devices (zram0) never touched."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.backends.base import Resources
from edged.cgroups import SandboxCgroup, probe
from edged.errors import BackendError
from edged.node import swap as swapmod
from edged.node.swap import (
    SwapManager,
    active_swaps,
    header_label,
    swap_header,
    zram_sizing,
)
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


def _held_open(dev: str, seconds: float) -> threading.Thread:
    """``dev`` opened read-only now and closed after ``seconds`` (as udev's probe of a new
    device, or of one after a swapoff, holds it open for a moment)."""
    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)

    def close() -> None:
        time.sleep(seconds)
        os.close(fd)

    t = threading.Thread(target=close, daemon=True)
    t.start()
    return t


def _remove_left(n: int) -> None:
    """Our zram device ``n``, no longer held open, swapped off and removed."""
    with contextlib.suppress(OSError):
        swapmod._syscall_path("swapoff", f"/dev/zram{n}")
    Path(f"/sys/block/zram{n}/reset").write_text("1")
    (ZRAM / "hot_remove").write_text(str(n))


@pytest.mark.root
@needs_zram
def test_a_device_held_open_for_a_moment_is_still_removed(tmp_path: Path) -> None:
    """zram's reset and hot_remove refuse (EBUSY) while the device is open, as udev holds a
    new device or one after swapoff open to probe it (the node VM: a half-made device left
    by a crashed daemon failed the next start with EBUSY). Held open for 0.5 s at stop and
    at the next start's clean-up, our device is removed all the same, once it is let go."""
    a = SwapManager(tmp_path, mode="zram", zram_bytes=32 * MiB)
    a.start(set_up=True)
    n = a.zram
    assert n is not None
    ident = zram.identity(f"zram{n}")
    holder = _held_open(f"/dev/zram{n}", 0.5)
    try:
        a.stop()
    finally:
        holder.join()
        left = not zram.gone(f"zram{n}", ident)
        if left:  # the old code's EBUSY (logged): remove it ourselves
            _remove_left(n)
    assert not left and a.zram is None
    # a device hot-added, never configured, held open when the next daemon starts
    m = int((ZRAM / "hot_add").read_text())
    half = zram.identity(f"zram{m}")
    (tmp_path / "swap.json").write_text(json.dumps({"zram": m, "file": None}))
    holder = _held_open(f"/dev/zram{m}", 0.5)
    c = SwapManager(tmp_path, mode="off")
    try:
        c.start()
    finally:
        holder.join()
        if not zram.gone(f"zram{m}", half):  # the old code's EBUSY: remove it ourselves
            _remove_left(m)
    assert zram.gone(f"zram{m}", half) and not (tmp_path / "swap.json").exists()
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
    prios: list[int] = []
    monkeypatch.setattr(m, "_add_file", lambda n, p: added.append(n) or prios.append(p)
                        or tmp_path / "f")
    m._grow()
    assert added == [16 * MiB] and prios == [swapmod.FILE_PRIORITY]  # slots full: below it
    assert m.room(2.5) == (0, 64 * MiB)  # our zram full; the files may grow by 64 MiB
    assert [a.path for a in m.areas()] == [f"{dev}/zram5"]


def test_zram_sized_so_its_ram_limit_is_the_wall() -> None:
    """The device's slots are its RAM limit × the ratio expected; the slot table (20 B per
    4 KiB page, up front) and the limit together stay within the RAM budget. A device sized
    at the capacity (the old default: 23.5 GiB of slots for a 17.7 GiB RAM limit) filled
    its slots with a third of its RAM used at 2.8:1."""
    gib = 1 << 30
    budget = int(17.7 * gib)
    disksize, limit = zram_sizing(budget)
    table = disksize // 4096 * swapmod.TABLE_BYTES_PER_PAGE
    assert disksize == int(limit * 3.0) // 4096 * 4096 and disksize % 4096 == 0
    assert limit + table <= budget < limit + table + 4096 * 3
    assert 240 * MiB < table < 270 * MiB  # ~1.4% of the budget at 3:1
    # at 2.8:1 (idle python) and 2.1:1 (agent heaps) the RAM limit fills before the slots
    for ratio in (2.1, 2.8):
        assert limit * ratio < disksize
    d1, l1 = zram_sizing(budget, ratio=1.0)
    assert d1 == l1 // 4096 * 4096 and l1 > limit
    with pytest.raises(ValueError, match="below 1"):
        zram_sizing(budget, ratio=0.5)
    with pytest.raises(ValueError, match="too small"):
        zram_sizing(4096)


def _zram_fake(tmp_path: Path, orig: int, mem_used: int, mem_limit: int, slots: int,
               used_slots: int) -> SwapManager:
    """Our zram5 as /proc/swaps and mm_stat would show it (sizes in bytes)."""
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    (sysfs / "block/zram5").mkdir(parents=True, exist_ok=True)
    (sysfs / "block/zram5/mm_stat").write_text(
        f"{orig} {mem_used} {mem_used} {mem_limit} {mem_used} 0 0 0 0\n")
    fake = tmp_path / "swaps"
    fake.write_text("Filename\tType\tSize\tUsed\tPriority\n"
                    f"{dev}/zram5  partition\t{slots // 1024}\t{used_slots // 1024}\t100\n")
    return SwapManager(tmp_path / "state", mode="zram", zram=5, sys=sysfs, dev=dev,
                       proc_swaps=str(fake))


@pytest.mark.parametrize("ratio", [1.0, 2.8, 0.9])
def test_free_swap_is_the_fewer_of_slots_and_ram_left(tmp_path: Path, ratio: float) -> None:
    """Free swap in our device = min(free slots, RAM limit left × the compression observed):
    at 1:1, at 2.8:1, and incompressible pages (0.9:1, the allocator's overhead on top,
    counted as 1:1). 3 GiB of slots, 1 GiB of RAM limit, 512 MiB of it used."""
    orig = int(512 * MiB * ratio)
    m = _zram_fake(tmp_path, orig=orig, mem_used=512 * MiB, mem_limit=1024 * MiB,
                   slots=3072 * MiB, used_slots=orig)
    observed = max(1.0, ratio)
    assert m.ratio() == pytest.approx(observed)
    compressed, plain = m.room()
    assert plain == 0
    assert compressed == min(3072 * MiB - orig // 1024 * 1024, int(512 * MiB * observed))
    u = m.usage()
    assert u["room_bytes"] == compressed and not u["zram_full"]
    assert u["ratio"] == round(observed, 2)


def test_a_ram_full_zram_is_full_though_it_has_slots(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Our device at its RAM limit (1020 MiB of its 1 GiB, 6 GiB of slots, at 1:1) has no
    room, says so, and a swap file added then goes above it in priority (the kernel would
    send pages to the device first, and fail them, before a file below it)."""
    m = _zram_fake(tmp_path, orig=1020 * MiB, mem_used=1020 * MiB, mem_limit=1024 * MiB,
                   slots=6144 * MiB, used_slots=1020 * MiB)
    assert m.room() == (4 * MiB, 0)
    assert m.usage()["zram_full"]
    (tmp_path / "state").mkdir()
    m.file_bytes, m.file_step_bytes, m.disk_reserve = 64 * MiB, 32 * MiB, 0.0
    assert m.room() == (4 * MiB, 64 * MiB)
    added: list[tuple[int, int]] = []
    monkeypatch.setattr(m, "_add_file", lambda n, p: added.append((n, p)) or tmp_path / "f")
    m._grow()
    assert added == [(32 * MiB, swapmod.ZRAM_PRIORITY + 1)]


@contextlib.contextmanager
def _memory_cgroups(tmp_path: Path, n: int) -> Iterator[list[SandboxCgroup]]:
    """``n`` sandbox cgroups of the cgroups room (:func:`edged.cgroups.probe` beneath this
    process's own, 256 MiB each, swap allowed), so that reclaim is the product's own: v1's
    ``memory.force_empty`` or v2's ``memory.reclaim`` (pytest skips without either). Their
    tasks killed and the cgroups removed at the end."""
    hier = probe(subdir=f"i17-zram-{os.getpid()}-{tmp_path.name}")
    if hier.version == "none" or not hier.features()["memory_reclaim"]:
        pytest.skip(f"needs a memory cgroup with proactive reclaim (cgroups: {hier.version})")
    cgs: list[SandboxCgroup] = []
    try:
        for i in range(n):
            cgs.append(hier.create(f"hog{i}", Resources(memory_bytes=256 * MiB), os.getuid()))
        yield cgs
    finally:
        for cg in cgs:
            cg.remove()
        hier.prune()
        assert not any(p.exists() for p in hier.parents.values())


def _hog(cg: SandboxCgroup, mib: int, procs: list[subprocess.Popen[str]]) -> None:
    """A process of ``mib`` MiB of random (incompressible) bytes in sandbox cgroup ``cg``
    (its memory cgroup: :meth:`SandboxCgroup.memory_join`), added to ``procs``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\nsys.stdin.readline()\n"
         f"b = bytearray(os.urandom({mib} << 20))\nprint('ok', flush=True)\ntime.sleep(900)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    join = cg.memory_join()
    assert join is not None
    join.write_text(str(proc.pid))  # before it allocates: it waits for a line
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "ok\n"


def _page_out(cg: SandboxCgroup, mib: float) -> None:
    """``mib`` MiB of ``cg`` paged out (v2 ``memory.reclaim``), or all the kernel can (v1
    ``memory.force_empty``): the product's reclaim."""
    assert cg.reclaim(int(mib * MiB))


def _fill(m: SwapManager, cg: SandboxCgroup) -> None:
    """Page ``cg`` out until our zram device is at its RAM limit. v1: ``memory.force_empty``
    once (all of it: the device takes what fits, the rest is refused). v2: ``memory.reclaim``
    in steps of 256 KiB until less than 512 KiB of the limit is left, since a request the
    device cannot take whole retries until 16 passes free nothing, each failing every write
    (~3 min under the node VM's emulation, 849k failed writes on 6.1)."""
    if cg.version != "v2":
        _page_out(cg, 256)
        return
    for _ in range(128):
        z = m.zram_stats()
        assert z is not None
        if z["mem_limit_bytes"] - z["mem_used_bytes"] < MiB // 2:
            return
        _page_out(cg, 0.25)
    raise AssertionError(f"the device did not fill: {m.zram_stats()}")


def _resident(cg: SandboxCgroup) -> int:
    return cg.memory_usage().resident_bytes


def _end(procs: list[subprocess.Popen[str]]) -> None:
    """Kill our processes ``procs`` and close their pipes."""
    for proc in procs:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


@pytest.mark.root
@needs_zram
def test_a_real_zram_device_fills_to_its_ram_limit(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A zram device of ours with 128 MiB of slots and 16 MiB of RAM, a process of 48 MiB of
    random (incompressible) bytes paged out into it (the cgroups room's reclaim of a sandbox
    cgroup made beneath this process's own: v1 ``memory.force_empty``, all of it; v2
    ``memory.reclaim``, up to its RAM limit: see :func:`_fill`): the device fills
    its RAM limit with slots to spare, says it is full, has (nearly) no room left; the pages
    that did not fit stay resident (nothing is lost); at stop the device is gone."""
    # above every other swap area (other helpers' daemons have zram at 100): ours fills
    monkeypatch.setattr(swapmod, "ZRAM_PRIORITY", 32000)
    zram0 = _zram_snapshot()
    m = SwapManager(tmp_path, mode="zram", zram_bytes=128 * MiB, zram_mem_limit_bytes=16 * MiB)
    procs: list[subprocess.Popen[str]] = []
    with _memory_cgroups(tmp_path, 1) as (cg,):
        m.start()
        try:
            assert m.ensure() and m.zram is not None
            dev, ident = f"zram{m.zram}", zram.identity(f"zram{m.zram}")
            u0 = m.usage()
            assert not u0["zram_full"] and 39 * MiB < u0["room_bytes"] <= 40 * MiB  # 2.5:1
            _hog(cg, 48, procs)
            _fill(m, cg)
            z = m.zram_stats()
            assert z is not None and z["mem_used_bytes"] >= 15 * MiB  # its RAM limit: the wall
            assert z["orig_bytes"] < 20 * MiB  # ~1:1, of 128 MiB of slots
            u = m.usage()
            assert u["zram_full"] and u["room_bytes"] < 2 * MiB, u
            assert m.room()[0] < 2 * MiB
            # what did not fit is resident still: nothing lost
            assert _resident(cg) > 28 * MiB
            assert procs[0].poll() is None
        finally:
            _end(procs)
            m.stop()
    assert zram.gone(dev, ident)
    assert _zram_snapshot() == zram0


def test_a_ram_full_zram_hides_the_swap_below_it(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Our device at its RAM limit with slots to spare, and two swap files of ours below it
    (added while it still had RAM left): the kernel gives every page a slot of the device
    and fails its write, never reaching the files, so they are no room (before: 1 GiB of
    room, and the reclaimer paged sandboxes into the device for nothing, a core busy). The
    empty one is moved above the device (swapoff, swapon at a higher priority); the one
    holding pages stays (its swapoff would read them back) and a new file goes above."""
    m = _zram_fake(tmp_path, orig=1020 * MiB, mem_used=1020 * MiB, mem_limit=1024 * MiB,
                   slots=6144 * MiB, used_slots=1100 * MiB)
    state = tmp_path / "state"
    state.mkdir()
    f0, f1 = state / "swapfile.0", state / "swapfile.1"
    for f in (f0, f1):
        f.write_bytes(b"\0" * 4096)
    m.files = [f0, f1]
    swaps = Path(m.proc_swaps)
    swaps.write_text(swaps.read_text()
                     + f"{f0}  file\t{512 * 1024}\t0\t10\n"
                     + f"{f1}  file\t{512 * 1024}\t{100 * 1024}\t10\n")
    assert m.room() == (4 * MiB, 0)  # the files are behind the device
    assert m.usage()["zram_full"]
    calls: list[tuple[str, str, tuple[int, ...]]] = []

    def syscall(name: str, path: str, *args: int) -> None:
        calls.append((name, path, args))
        if name == "swapon":  # as /proc/swaps would show it after
            text = swaps.read_text().replace(f"{path}  file\t{512 * 1024}\t0\t10",
                                             f"{path}  file\t{512 * 1024}\t0\t{args[0] & 0x7FFF}")
            swaps.write_text(text)

    monkeypatch.setattr(swapmod, "_syscall_path", syscall)
    added: list[tuple[int, int]] = []
    monkeypatch.setattr(m, "_add_file", lambda n, p: added.append((n, p)) or tmp_path / "f")
    m.file_bytes, m.file_step_bytes, m.disk_reserve = 4096 * MiB, 1024 * MiB, 0.0
    m._grow()
    prio = swapmod.ZRAM_PRIORITY + 1 + 2
    assert calls == [("swapoff", str(f0), ()),
                     ("swapon", str(f0), (swapmod.SWAP_FLAG_PREFER | prio,))]
    assert m._free(m.ratio()) == (4 * MiB, 512 * MiB)  # f0 above it now; f1 still behind
    assert added == []  # 516 MiB free: at least half a step
    # f0 filled: another file, above the device
    swaps.write_text(swaps.read_text().replace(f"{f0}  file\t{512 * 1024}\t0",
                                               f"{f0}  file\t{512 * 1024}\t{512 * 1024}"))
    m._grow()
    assert added == [(1024 * MiB, swapmod.ZRAM_PRIORITY + 1 + 2)]
    assert len(calls) == 2  # f1 holds pages: left where it is


@pytest.mark.root
@needs_zram
def test_a_real_file_below_a_ram_full_zram_is_moved_above_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zram device of ours (128 MiB of slots, 16 MiB of RAM) and a swap file of ours
    added while the device had RAM left, so below it. 48 MiB of incompressible pages paged
    out (the cgroups room's reclaim, v1 or v2): the device fills its RAM, the rest stays
    resident and the file below gets nothing (the kernel sends every page to the device and
    fails it), so the file is no room. The next ensure moves the empty file above the
    device; pages paged out then go to the file. At stop both are gone."""
    monkeypatch.setattr(swapmod, "ZRAM_PRIORITY", 32000)  # above other helpers' devices
    zram0 = _zram_snapshot()
    m = SwapManager(tmp_path, mode="zram", zram_bytes=128 * MiB, zram_mem_limit_bytes=16 * MiB,
                    file_bytes=96 * MiB, file_step_bytes=128 * MiB, disk_reserve=0.0)
    procs: list[subprocess.Popen[str]] = []
    with _memory_cgroups(tmp_path, 2) as cgs:
        m.start()
        try:
            assert m.ensure() and m.zram is not None and len(m.files) == 1
            dev, ident = f"zram{m.zram}", zram.identity(f"zram{m.zram}")
            f0 = str(m.files[0])

            def area(path: str) -> swapmod.SwapArea:
                return next(a for a in active_swaps() if os.path.realpath(a.path) ==
                            os.path.realpath(path))

            assert area(f0).priority == swapmod.FILE_PRIORITY  # below the device
            _hog(cgs[0], 48, procs)
            _fill(m, cgs[0])
            z = m.zram_stats()
            assert z is not None and z["mem_used_bytes"] >= 15 * MiB  # at its RAM limit
            assert area(f0).used_bytes == 0  # never reached
            assert _resident(cgs[0]) > 28 * MiB  # resident
            assert sum(m._free(m.ratio())) < 2 * MiB  # the file behind it is no room
            m.ensure()
            assert area(f0).priority > 32000 and len(m.files) == 1  # moved above, not new
            assert m.room()[1] > 90 * MiB
            _hog(cgs[1], 24, procs)
            _page_out(cgs[1], 40)  # its interpreter too
            assert area(f0).used_bytes >= 20 * MiB  # the new pages went to the file
            assert _resident(cgs[1]) < 8 * MiB
            assert all(p.poll() is None for p in procs)
        finally:
            _end(procs)
            files = list(m.files)
            m.stop()
    assert zram.gone(dev, ident)
    assert not any(f.exists() or _ours(str(f)) for f in files)
    assert _zram_snapshot() == zram0
