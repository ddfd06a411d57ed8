"""The node's swap, where reclaimed sandbox pages go: a compressed zram device that edged sets
up itself when the host has no swap, and swap files on disk behind it, added as it fills.

Setting swap up is host-wide, so edged owns exactly what it made and nothing else:
- a zram device of its own, hot-added (``/sys/class/zram-control/hot_add``; ``zram0`` and any
  other device belong to the host or to someone else and are never touched), labelled in its
  swap header with ``edged-<hash of the state dir>`` so that it is recognised after a crash;
- swap files in the state dir (``swapfile.N``), at a lower priority than the zram device, for
  what does not fit in RAM even compressed: the kernel fills the zram device first and then
  the files (swap areas are used by priority, the next once the higher is full), and a file
  is added, ``file_step_bytes`` at a time, whenever the free swap left falls below half a
  step, up to ``file_bytes`` in all and never leaving less than ``disk_reserve`` of their
  filesystem free (like swapspace(8): disk is taken only as far as reclaim needs it);
- the zram device's size (``disksize``, pages it can hold uncompressed) is its RAM limit
  (``mem_limit``) times the compression expected (:data:`EXPECTED_RATIO`, 3:1; idle Python
  interpreters compress 2.8:1 here, agent heaps 2.1:1), less the slot table it costs up front
  (:func:`zram_sizing`), so the RAM limit, not the page count, is the wall for most memory
  (a device sized at the capacity filled its 23.5 GiB of slots with a third of its RAM limit
  used). Free swap is counted honestly: our device takes what fits in its slots *and* in the
  RAM left at the compression observed (:meth:`SwapManager.room`). A device whose RAM is full
  fails every write to it (the pages stay resident, the kernel logs "Write-error on
  swap-device"), while the kernel still sends pages to it first (it has slots): so a swap
  file added then goes *above* it in priority (an empty one added below it earlier is moved
  above), the areas below such a device count as no room (the kernel never reaches them),
  and reclaim stops paging into a swap that has no room (:mod:`edged.node.reclaim`);
- a record of all of it in ``<state_dir>/swap.json``, written before each is configured.
At start a record left by a crashed daemon is honoured: a device of ours still in use as swap
is adopted (sandboxes kept across the restart may have pages in it), one that never reached
``swapon`` is removed. At stop everything is switched off and removed (swapoff reads back
whatever is still swapped, so the daemon stops its sandboxes first), unless sandboxes are kept
running for the next daemon, which then adopts the device.

``mode``: ``"auto"`` (default): the host's own swap if it has any (zswap in front of it where
the host enabled it; another edged daemon's devices, known by their label, are not the
host's: they go when that daemon stops), else a zram device of ours and swap files;
``"zram"``: those whatever the host has; ``"off"``: none (reclaim then only drops file pages).

Sources: Documentation/admin-guide/blockdev/zram.rst (hot_add/hot_remove, comp_algorithm,
disksize, mem_limit, reset, mm_stat columns), include/linux/swap.h (``union swap_header``:
magic ``SWAPSPACE2`` in the last 10 bytes of the first page, version 1, last_page,
volume label at byte 1052), swapon(2) (``SWAP_FLAG_PREFER``, priorities 0..32767),
Documentation/admin-guide/mm/zswap.rst.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.errors import BackendError

log = logging.getLogger("edged.swap")

#: compression the zram device is sized for (see the module)
EXPECTED_RATIO = 3.0
#: RAM the kernel takes up front per 4 KiB page of a zram swap device: zram's table entry
#: (drivers/block/zram/zram_drv.h ``struct zram_table_entry``: handle + flags, 16 B) at
#: ``disksize``, and at ``swapon`` the swap map (1 B) and the swap cgroup id (2 B).
#: Measured on this kernel: a 4 GiB device took 16.4 MiB of vmalloc at disksize, +3 MiB at
#: swapon (19 B per page).
TABLE_BYTES_PER_PAGE = 20
#: compression assumed before our device holds enough to tell (see SwapManager.ratio)
DEFAULT_RATIO = 2.5
#: below this much room (bytes of pages) our swap counts as full (reported, see usage())
FULL_MARGIN = 64 << 20
SWAP_FLAG_PREFER = 0x8000
SWAP_FLAG_PRIO_MASK = 0x7FFF
SWAP_MAGIC = b"SWAPSPACE2"
_LABEL_OFF = 1024 + 4 + 4 + 4 + 16  # bootbits, version, last_page, nr_badpages, uuid
ZRAM_PRIORITY = 100
FILE_PRIORITY = 10
MODES = ("auto", "zram", "off")
#: seconds a zram ``reset`` or ``hot_remove`` refused with EBUSY is retried (a device held
#: open for a moment by udev's probe of it; see SwapManager._remove_zram)
ZRAM_BUSY_WAIT_S = 10.0

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _syscall_path(name: str, path: str, *args: int) -> None:
    fn = getattr(_libc, name)
    if fn(os.fsencode(path), *args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name} `{path}`: {os.strerror(e)}")


def _while_busy(what: str, fn: Callable[[], None]) -> None:
    """Call ``fn`` until it does not fail with EBUSY, for at most :data:`ZRAM_BUSY_WAIT_S`
    (then the last EBUSY is raised); other errors at once."""
    deadline = time.monotonic() + ZRAM_BUSY_WAIT_S
    delay = 0.01
    while True:
        try:
            fn()
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            log.debug("swap: %s: busy (held open, e.g. udev probing it); retrying", what)
        time.sleep(delay)
        delay = min(0.2, delay * 2)


def zram_budget(capacity_bytes: int, mem_total_bytes: int, reserve_bytes: int) -> int:
    """The RAM in bytes our zram device may take by default: 3/4 of the sandboxes' memory
    capacity (``capacity_bytes``, configured or MemTotal), but never more than 3/4 of what
    the node really has for sandboxes: MemTotal less the host's reserve (the bound
    sandboxes' memory together gets too), at least a quarter of MemTotal (a node smaller
    than its reserve still gets a device). A capacity configured above the RAM
    (``--memory-bytes 256G`` on a 4 GiB node, as tests/edged/test_nofile_e2e.py does) had
    sized a 567 GiB device, whose slot table, vmalloc'd at ``disksize`` (16-24 B a page:
    24 with CONFIG_ZRAM_MEMORY_TRACKING, as Debian's 6.1 has) and at ``swapon`` (3 B a
    page), took ~3.5 GiB of the 4 GiB node VM at its first reclaim: a global OOM with the
    memory in none of the OOM report's counters (vmalloc is not among them)."""
    node = max(mem_total_bytes - reserve_bytes, mem_total_bytes // 4)
    return max(0, min(capacity_bytes, node)) * 3 // 4


def zram_sizing(ram_bytes: int, ratio: float = EXPECTED_RATIO,
                page: int = 4096) -> tuple[int, int]:
    """``(disksize, mem_limit)`` in bytes for a zram device that may take ``ram_bytes`` of
    RAM in all: its slot table (:data:`TABLE_BYTES_PER_PAGE` a page, up front) plus at most
    ``mem_limit`` of compressed pages, with ``disksize`` = ``mem_limit`` × ``ratio`` (whole
    pages), so pages compressing less than ``ratio`` fill the RAM limit before the slots.
    Raises ValueError for a ratio below 1 or a budget too small for a swap area."""
    if ratio < 1:
        raise ValueError(f"zram ratio {ratio}: below 1")
    mem_limit = int(ram_bytes / (1 + ratio * TABLE_BYTES_PER_PAGE / page))
    disksize = int(mem_limit * ratio) // page * page
    if disksize < 16 * page:
        raise ValueError(f"zram RAM budget of {ram_bytes} bytes is too small")
    return disksize, mem_limit


def swap_header(size_bytes: int, label: str, page_size: int | None = None) -> bytes:
    """The first page of a swap area of ``size_bytes`` (what ``mkswap -L label`` writes):
    version 1, last usable page, no bad pages, a random uuid, the label (≤ 16 bytes)."""
    page = page_size or os.sysconf("SC_PAGE_SIZE")
    last_page = size_bytes // page - 1
    if last_page < 10:
        raise ValueError(f"swap area of {size_bytes} bytes is too small")
    name = label.encode()
    if len(name) > 16:
        raise ValueError(f"swap label {label!r} is longer than 16 bytes")
    buf = bytearray(page)
    struct.pack_into("<III16s16s", buf, 1024, 1, last_page, 0, os.urandom(16), name)
    buf[page - 10 :] = SWAP_MAGIC
    return bytes(buf)


def header_label(first_page: bytes) -> str | None:
    """The label of a swap header, or None if ``first_page`` is not one."""
    if len(first_page) < 4096 or first_page[-10:] != SWAP_MAGIC:
        return None
    raw = first_page[_LABEL_OFF : _LABEL_OFF + 16]
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


@dataclass(frozen=True)
class SwapArea:
    """One line of ``/proc/swaps``: path, kind, sizes in bytes, priority."""

    path: str
    kind: str
    size_bytes: int
    used_bytes: int
    priority: int


def active_swaps(path: str = "/proc/swaps") -> list[SwapArea]:
    """The host's active swap areas (``/proc/swaps``; paths with spaces come octal-escaped)."""
    out = []
    with open(path) as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) >= 5:
                name = parts[0].encode().decode("unicode_escape")
                out.append(SwapArea(name, parts[1], int(parts[2]) * 1024,
                                    int(parts[3]) * 1024, int(parts[4])))
    return out


def zswap_enabled(root: Path = Path("/sys/module/zswap/parameters")) -> bool:
    """Whether the host enabled zswap (a compressed cache in front of its swap devices)."""
    try:
        return (root / "enabled").read_text().strip() in ("Y", "1")
    except OSError:
        return False


@dataclass
class SwapManager:
    """Sets up, reports and removes the node's swap for reclaimed sandbox pages.

    ``state_dir``: where ``swap.json`` (what this daemon made) and the swap file live.
    ``zram_bytes``: the zram device's size, in uncompressed bytes of swapped pages (its slot
    table costs 16 bytes of RAM per 4 KiB page up front). ``zram_mem_limit_bytes``: the most
    RAM its compressed pages may take (0: no limit). ``algorithm``: one the kernel offers
    (``/sys/block/zramN/comp_algorithm``; on the dev VM ``lzo-rle`` compressed idle Python
    heaps 2.7:1, ``lz4`` 2.5:1). ``file_bytes``: the most bytes of swap files behind it (0:
    none), added ``file_step_bytes`` at a time as swap fills (see the module), keeping
    ``disk_reserve`` (bytes, or a share of the filesystem's size if below 1) of their
    filesystem free. ``sys``/``dev``/``proc_swaps``: the filesystems read and written.
    Errors: BackendError naming the step (the half-made device removed first).
    """

    state_dir: Path
    mode: str = "auto"
    zram_bytes: int = 0
    zram_mem_limit_bytes: int = 0
    algorithm: str = "lzo-rle"
    file_bytes: int = 0
    file_step_bytes: int = 1 << 30
    disk_reserve: float = 0.1
    sys: Path = Path("/sys")
    dev: Path = Path("/dev")
    proc_swaps: str = "/proc/swaps"
    zram: int | None = None  # our device number
    files: list[Path] = field(default_factory=list)  # our swap files, oldest first
    host: list[SwapArea] = field(default_factory=list)
    adopted: bool = False

    def __post_init__(self) -> None:
        self._setup_lock = threading.Lock()
        self._tried = False
        self._labels: dict[tuple[str, int, int], str | None] = {}  # see _another_daemons
        if self.mode not in MODES:
            raise ValueError(f"swap mode {self.mode!r}: not one of {', '.join(MODES)}")
        digest = hashlib.sha256(str(Path(self.state_dir).resolve()).encode()).hexdigest()
        self.label = "edged-" + digest[:10]

    # -- the record -----------------------------------------------------------------------

    @property
    def _record(self) -> Path:
        return Path(self.state_dir) / "swap.json"

    def _save(self) -> None:
        rec = {"label": self.label, "zram": self.zram, "files": [str(f) for f in self.files]}
        tmp = self._record.with_name(".swap.json.tmp")
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(rec, f)
            f.flush()
            os.fsync(f.fileno())  # the only trace of a device we made, if we crash
        os.replace(tmp, self._record)

    def _load(self) -> dict[str, Any]:
        try:
            rec: dict[str, Any] = json.loads(self._record.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("swap record %s unreadable, ignored: %s", self._record, e)
            return {}
        return rec

    # -- zram plumbing --------------------------------------------------------------------

    def _zdir(self, n: int) -> Path:
        return self.sys / "block" / f"zram{n}"

    def _zdev(self, n: int) -> str:
        return str(self.dev / f"zram{n}")

    def _label(self, path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                return header_label(f.read(os.sysconf("SC_PAGE_SIZE")))
        except OSError:
            return None

    def _is_ours(self, path: str) -> bool:
        return self._label(path) == self.label

    def _another_daemons(self, path: str) -> bool:
        """Whether swap area ``path`` is another edged daemon's (its label): that daemon
        removes it when it stops, so it is not the host's swap to rely on. Each device or
        file is read once (known by its inode and device number, which a hot-added device
        or a new file does not share with an earlier one under the same name): an open
        device makes its owner's zram ``reset`` and ``hot_remove`` fail with EBUSY, so the
        daemon opens another's device as rarely as it can."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        key = (os.path.realpath(path), st.st_ino, st.st_rdev)
        if key not in self._labels:
            self._labels[key] = self._label(path)
        label = self._labels[key]
        return label is not None and label.startswith("edged-") and label != self.label

    def _active(self, path: str) -> SwapArea | None:
        real = os.path.realpath(path)
        for a in active_swaps(self.proc_swaps):
            if os.path.realpath(a.path) == real:
                return a
        return None

    def _remove_zram(self, n: int) -> None:
        """swapoff (if active), reset and hot_remove zram device ``n``. Both refuse with
        EBUSY while anything has the device open (drivers/block/zram/zram_drv.c
        ``reset_store``, ``zram_remove``), and on a node with udev something briefly does:
        a new device or a swapoff raises a uevent and udev's rules open the device to probe
        it (blkid), so an EBUSY is retried for up to :data:`ZRAM_BUSY_WAIT_S`. Raises
        OSError (EBUSY after that)."""
        if self._active(self._zdev(n)) is not None:
            _syscall_path("swapoff", self._zdev(n))
        _while_busy(f"zram{n}: reset", lambda: self._sysfs_write(self._zdir(n) / "reset", "1"))
        _while_busy(f"zram{n}: hot_remove", lambda: self._sysfs_write(
            self.sys / "class/zram-control/hot_remove", str(n), errno.ENODEV))

    @staticmethod
    def _sysfs_write(path: Path, value: str, *gone: int) -> None:
        """Write ``value`` to ``path``; a missing file or an errno in ``gone`` is no error
        (the device is gone already)."""
        try:
            path.write_text(value)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in gone:
                raise

    def _add_zram(self) -> int:
        ctl = self.sys / "class/zram-control/hot_add"
        try:
            n = int(ctl.read_text())
        except OSError as e:
            raise BackendError(f"zram: hot_add: {e.strerror} (no zram in this kernel?)") from e
        self.zram = n
        self._save()  # before anything else: a crash from here on leaves a record
        zd = self._zdir(n)
        try:
            algos = (zd / "comp_algorithm").read_text().replace("[", "").replace("]", "")
            if self.algorithm not in algos.split():
                raise BackendError(f"zram: compression {self.algorithm!r} not offered "
                                   f"(have: {algos.strip()})")
            (zd / "comp_algorithm").write_text(self.algorithm)
            (zd / "disksize").write_text(str(self.zram_bytes))
            if self.zram_mem_limit_bytes:
                (zd / "mem_limit").write_text(str(self.zram_mem_limit_bytes))
            fd = os.open(self._zdev(n), os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, swap_header(self.zram_bytes, self.label))
            finally:
                os.close(fd)
            _syscall_path("swapon", self._zdev(n),
                          SWAP_FLAG_PREFER | (ZRAM_PRIORITY & SWAP_FLAG_PRIO_MASK))
        except (OSError, BackendError) as e:
            with contextlib.suppress(OSError):
                self._remove_zram(n)
            self.zram = None
            self._save()
            if isinstance(e, BackendError):
                raise
            raise BackendError(f"zram{n}: set up: {e}") from e
        return n

    def _file_room(self) -> int:
        """Bytes more of swap files we may add now: within ``file_bytes`` and the disk
        reserve of the state dir's filesystem."""
        have = sum(self._file_size(f) for f in self.files)
        left = self.file_bytes - have
        if left <= 0:
            return 0
        try:
            st = os.statvfs(self.state_dir)
        except OSError:
            return 0
        size = st.f_blocks * st.f_frsize
        reserve = int(self.disk_reserve * size) if self.disk_reserve < 1 else int(
            self.disk_reserve)
        return max(0, min(left, st.f_bavail * st.f_frsize - reserve))

    @staticmethod
    def _file_size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return 0

    def _add_file(self, nbytes: int, priority: int = FILE_PRIORITY) -> Path:
        """A swap file of ``nbytes`` (whole pages) in the state dir, active at ``priority``;
        recorded before it is made. Raises BackendError (nothing left of it)."""
        page = os.sysconf("SC_PAGE_SIZE")
        nbytes -= nbytes % page
        n = 0
        while (Path(self.state_dir) / f"swapfile.{n}") in self.files or (
                Path(self.state_dir) / f"swapfile.{n}").exists():
            n += 1
        path = Path(self.state_dir) / f"swapfile.{n}"
        self.files.append(path)
        self._save()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # no holes: swapon refuses them
                os.pwrite(fd, swap_header(nbytes, self.label), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            _syscall_path("swapon", str(path),
                          SWAP_FLAG_PREFER | (priority & SWAP_FLAG_PRIO_MASK))
        except (OSError, ValueError) as e:
            with contextlib.suppress(OSError):
                path.unlink()
            self.files.remove(path)
            self._save()
            raise BackendError(f"swap file {path}: set up: {e}") from e
        log.info("swap: added %s (%d MiB, priority %d)", path, nbytes >> 20, priority)
        return path

    def _grow(self) -> None:
        """Add a swap file if the free swap left (counted as :meth:`room` does) is below half
        a step (see the module). With our zram device's RAM full while it has slots, the
        file goes above it in priority: the kernel would go on sending pages to the device
        (and failing) before a file below it."""
        if self.file_bytes <= 0:
            return
        ratio = self.ratio()
        if self._zram_ram_full(ratio):
            self._raise_files()
        compressed, plain = self._free(ratio)
        if compressed + plain >= self.file_step_bytes // 2 and (
                self.zram is not None or self.files):
            return
        room = self._file_room()
        if room < min(self.file_step_bytes // 2, 64 << 20):  # too little to be worth it
            return
        prio = FILE_PRIORITY
        if self._zram_ram_full(ratio):
            prio = ZRAM_PRIORITY + 1 + len(self.files)
        self._add_file(min(self.file_step_bytes, room), prio)

    def _raise_files(self) -> None:
        """Move our empty swap files that sit below our zram device above it (swapoff, which
        has nothing to read back, and swapon at a higher priority): a file added while the
        device still had RAM left went below it, and once the device's RAM is full the
        kernel sends it every page and fails them, never reaching the file (the daemon spent
        a core compressing pages that stayed resident). A file holding pages stays where it
        is (its swapoff would read them back into RAM); :meth:`_grow` adds one above then.
        A file that cannot be switched back on is removed (and logged)."""
        areas = {os.path.realpath(a.path): a for a in active_swaps(self.proc_swaps)}
        zdev = areas.get(os.path.realpath(self._zdev(self.zram))) if self.zram is not None \
            else None
        if zdev is None:
            return
        for f in list(self.files):
            a = areas.get(os.path.realpath(f))
            if a is None or a.priority >= zdev.priority or a.used_bytes > 0:
                continue
            prio = min(SWAP_FLAG_PRIO_MASK, zdev.priority + 1 + len(self.files))
            try:
                _syscall_path("swapoff", str(f))
            except OSError as e:
                log.warning("swap: %s stays below zram%d: %s", f, self.zram, e)
                continue
            try:
                _syscall_path("swapon", str(f), SWAP_FLAG_PREFER | prio)
            except OSError as e:
                log.error("swap: %s: swapon at priority %d: %s (removed)", f, prio, e)
                with contextlib.suppress(OSError):
                    f.unlink()
                self.files.remove(f)
                self._save()
                continue
            log.info("swap: %s moved above zram%d (its RAM limit is full): priority %d",
                     f, self.zram, prio)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, set_up: bool = False) -> dict[str, Any]:
        """Recover what a previous daemon left (adopt a device still in use, remove one that
        is not); with ``set_up``, also set up what the mode asks for at once (else that waits
        for the first :meth:`ensure`: a node that never reclaims never makes a device).
        Returns :meth:`features`. Raises BackendError if a device cannot be set up (nothing
        half-made is left)."""
        rec = self._load()
        self.host = [a for a in active_swaps(self.proc_swaps)]
        z = rec.get("zram")
        files = [f for f in [rec.get("file"), *rec.get("files", [])] if isinstance(f, str)]
        if isinstance(z, int) and self._zdir(z).exists():
            path = self._zdev(z)
            if self._is_ours(path) and self._active(path) is not None:
                self.zram, self.adopted = z, True
                log.info("swap: adopted zram%d of an earlier daemon", z)
            elif self._is_ours(path) or self._disksize(z) == 0:
                log.info("swap: removing zram%d left half-made by an earlier daemon", z)
                self._remove_zram(z)
        for f in files:
            # ours only: a file of our state dir the record names (made O_EXCL)
            if Path(f).parent != Path(self.state_dir) or not Path(f).is_file():
                continue
            if self._is_ours(f) and self._active(f) is not None:
                self.files.append(Path(f))
                self.adopted = True
            elif self._is_ours(f) or self._label(f) is None:  # half-made (no header yet)
                with contextlib.suppress(OSError):
                    if self._active(f) is not None:
                        _syscall_path("swapoff", f)
                Path(f).unlink(missing_ok=True)
        ours = {os.path.realpath(p) for p in self._our_paths()}
        self.host = [a for a in self.host if os.path.realpath(a.path) not in ours
                     and not self._another_daemons(a.path)]
        if self.zram is None and not self.files:
            with contextlib.suppress(FileNotFoundError):
                self._record.unlink()
        else:
            self._save()
        if set_up:
            self.ensure()
        log.info("swap", extra=self.features())
        return self.features()

    @property
    def wanted(self) -> bool:
        """Whether this node sets up swap of its own (mode, and the host's swap)."""
        return self.mode == "zram" or (self.mode == "auto" and not self.host)

    def ensure(self) -> bool:
        """Set up our devices if the mode wants them and they are not there yet (at most
        once: a failure is logged and not retried), and add a swap file if swap runs short
        (a failure is logged; tried again at the next call). Returns whether any swap is
        active for reclaim to page into. Thread-safe; cheap when there is nothing to do
        (reads ``/proc/swaps``): reclaim calls it before each sandbox."""
        with self._setup_lock:
            if self.wanted and not self._tried:
                self._tried = True
                try:
                    if self.zram is None and self.zram_bytes > 0:
                        self._add_zram()
                    log.info("swap set up", extra=self.features())
                except BackendError as e:
                    log.error("swap: %s (reclaim goes on without swap of ours)", e)
            if self.wanted:
                try:
                    self._grow()
                except BackendError as e:
                    log.error("swap: %s", e)
        return bool(self.areas())

    def _disksize(self, n: int) -> int:
        try:
            return int((self._zdir(n) / "disksize").read_text())
        except (OSError, ValueError):
            return -1

    def _our_paths(self) -> list[str]:
        out = []
        if self.zram is not None:
            out.append(self._zdev(self.zram))
        out += [str(f) for f in self.files]
        return out

    def stop(self, keep: bool = False) -> None:
        """Switch off and remove our devices and the record; with ``keep`` (sandboxes left
        running for the next daemon) leave them for it to adopt. Errors are logged: a swapoff
        that cannot read every page back (ENOMEM) leaves the device active and recorded."""
        if keep:
            return
        self._tried = False
        if self.zram is not None:
            try:
                self._remove_zram(self.zram)
                self.zram = None
            except OSError as e:
                log.error("swap: cannot remove zram%d: %s", self.zram, e)
        for f in list(self.files):
            try:
                if self._active(str(f)) is not None:
                    _syscall_path("swapoff", str(f))
                f.unlink(missing_ok=True)
                self.files.remove(f)
            except OSError as e:
                log.error("swap: cannot remove %s: %s", f, e)
        if self.zram is None and not self.files:
            with contextlib.suppress(FileNotFoundError):
                self._record.unlink()
        else:
            self._save()

    # -- reporting ------------------------------------------------------------------------

    def zram_stats(self) -> dict[str, int] | None:
        """Our zram device's ``mm_stat``: ``orig_bytes`` (pages stored, uncompressed),
        ``compr_bytes``, ``mem_used_bytes`` (RAM taken, allocator overhead included),
        ``mem_limit_bytes``, ``same_pages`` (pages stored as one repeated word: free), or
        None without a device."""
        if self.zram is None:
            return None
        try:
            f = (self._zdir(self.zram) / "mm_stat").read_text().split()
        except OSError:
            return None
        return {"orig_bytes": int(f[0]), "compr_bytes": int(f[1]), "mem_used_bytes": int(f[2]),
                "mem_limit_bytes": int(f[3]), "same_pages": int(f[5])}

    def ratio(self) -> float:
        """The compression observed in our zram device (uncompressed ÷ RAM used, allocator
        overhead included); :data:`DEFAULT_RATIO` before it holds 64 MiB, and without a
        device of ours (a host's zram device is not ours to read)."""
        z = self.zram_stats()
        if z is None or z["orig_bytes"] < (64 << 20) or z["mem_used_bytes"] <= 0:
            return DEFAULT_RATIO
        return max(1.0, z["orig_bytes"] / z["mem_used_bytes"])

    def _zram_ram_left(self, ratio: float) -> int | None:
        """Bytes of pages our zram device's RAM limit still takes at ``ratio`` (None: no
        device of ours, or no limit)."""
        z = self.zram_stats()
        if z is None or z["mem_limit_bytes"] <= 0:
            return None
        return int(max(0, z["mem_limit_bytes"] - z["mem_used_bytes"]) * ratio)

    def _margin(self) -> int:
        """Room below which our swap counts as full: :data:`FULL_MARGIN`, or a 16th of a
        smaller device's RAM limit."""
        z = self.zram_stats()
        if z is None or z["mem_limit_bytes"] <= 0:
            return FULL_MARGIN
        return min(FULL_MARGIN, z["mem_limit_bytes"] // 16)

    def _zram_ram_full(self, ratio: float) -> bool:
        left = self._zram_ram_left(ratio)
        return left is not None and left < self._margin()

    def _blocking(self, areas: list[SwapArea], ratio: float) -> int | None:
        """The priority of our zram device if its RAM limit is full while it has free
        slots, else None. The kernel gives a page a slot of the highest-priority area with
        free slots and only then writes it: such a device takes every page and fails each
        write (the page stays resident, its slot held), so no area below it is reached."""
        if self.zram is None or not self._zram_ram_full(ratio):
            return None
        zdev = os.path.realpath(self._zdev(self.zram))
        for a in areas:
            if os.path.realpath(a.path) == zdev and a.size_bytes > a.used_bytes:
                return a.priority
        return None

    def _free(self, ratio: float) -> tuple[int, int]:
        """:meth:`room` without what the swap files may still grow by."""
        zdev = os.path.realpath(self._zdev(self.zram)) if self.zram is not None else None
        ram_left = self._zram_ram_left(ratio)
        compressed = plain = 0
        areas = self.areas()
        blocking = self._blocking(areas, ratio)
        for a in areas:
            if blocking is not None and a.priority < blocking:
                continue  # behind a RAM-full zram device: never reached (see _blocking)
            free = max(0, a.size_bytes - a.used_bytes)
            real = os.path.realpath(a.path)
            if real == zdev:
                compressed += free if ram_left is None else min(free, ram_left)
            elif os.path.basename(real).startswith("zram"):
                compressed += free
            else:
                plain += free
        return compressed, plain

    def room(self, ratio: float | None = None) -> tuple[int, int]:
        """Bytes of pages swap can take now: ``(compressed, uncompressed)``, i.e. what goes
        into a zram device (ours: the fewer of its free slots and of the pages its RAM limit
        still takes at compression ``ratio``, by default the observed :meth:`ratio`; the
        host's ``/dev/zram*``: its slots) and what goes to disk (the host's other swap, our
        swap files and what they may still grow by)."""
        compressed, plain = self._free(self.ratio() if ratio is None else ratio)
        if self.wanted and self.file_bytes > 0:
            plain += self._file_room()
        return compressed, plain

    def areas(self) -> list[SwapArea]:
        """Every active swap area this node may count on: ours and the host's, not another
        edged daemon's (its label; that daemon removes it when it stops, so its free room
        is not free swap here: counting it kept our swap files from growing)."""
        return [a for a in active_swaps(self.proc_swaps) if not self._another_daemons(a.path)]

    def features(self) -> dict[str, Any]:
        """What is in use, for the start-up log and ``GET /v1/node``."""
        areas = self.areas()
        ours = {os.path.realpath(p) for p in self._our_paths()}
        return {
            "mode": self.mode,
            "zram_device": None if self.zram is None else f"zram{self.zram}",
            "zram_algorithm": self.algorithm if self.zram is not None else None,
            "swap_files": [str(f) for f in self.files],
            "host_swap": [a.path for a in areas if os.path.realpath(a.path) not in ours],
            "zswap": zswap_enabled(self.sys / "module/zswap/parameters"),
            "adopted": self.adopted,
            "total_bytes": sum(a.size_bytes for a in areas),
        }

    def usage(self) -> dict[str, Any]:
        """``total_bytes``/``used_bytes`` of every active swap area, ``files_bytes``/
        ``files_used_bytes`` of our swap files, what our zram device holds (``zram_*``,
        see :meth:`zram_stats`); ``room_bytes``: pages swap can take now (:meth:`room`),
        ``ratio``: the compression observed (:meth:`ratio`), ``zram_full``: our device's
        RAM limit or all our swap has less than :data:`FULL_MARGIN` of room left (a 16th of
        the limit of a smaller device)."""
        areas = self.areas()
        files = {os.path.realpath(f) for f in self.files}
        mine = [a for a in areas if os.path.realpath(a.path) in files]
        out: dict[str, Any] = {"total_bytes": sum(a.size_bytes for a in areas),
               "used_bytes": sum(a.used_bytes for a in areas),
               "files_bytes": sum(a.size_bytes for a in mine),
               "files_used_bytes": sum(a.used_bytes for a in mine)}
        z = self.zram_stats()
        if z is not None:
            out.update({f"zram_{k}": v for k, v in z.items()})
        ratio = self.ratio()
        room = sum(self.room(ratio))
        out["room_bytes"] = room
        out["ratio"] = round(ratio, 2)
        out["zram_full"] = self._zram_ram_full(ratio) or (
            z is not None and room < self._margin())
        return out
