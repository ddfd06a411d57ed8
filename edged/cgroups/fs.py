"""Small readers and writers of cgroup files, and where this process sits in each hierarchy.

Sources: Documentation/admin-guide/cgroup-v1/{memory,freezer-subsystem,pids}.rst and
cgroup-v2.rst of the Linux tree (file names and formats); proc(5) for /proc/self/cgroup and
/proc/self/mountinfo.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write(path: Path, value: str) -> None:
    """Write ``value`` to a cgroup file in one write(2) (the kernel parses each write)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read().decode()


def key(path: Path, name: str) -> int:
    """The value of ``name N`` in a flat-keyed file (memory.events, pids.events, cpu.stat...);
    0 if absent. Raises OSError, ValueError."""
    for line in read(path).splitlines():
        k, _, v = line.partition(" ")
        if k == name:
            return int(v)
    return 0


def flat_keyed(path: Path) -> dict[str, int]:
    """A flat-keyed file (``memory.stat``, ``cpu.stat``) as ``{key: value}``. Raises
    OSError."""
    out: dict[str, int] = {}
    for line in read(path).splitlines():
        k, _, v = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[k] = int(v)
    return out


def self_cgroups() -> dict[str, str]:
    """controller name -> path from /proc/self/cgroup ("" key for the v2 line)."""
    out: dict[str, str] = {}
    for line in read(Path("/proc/self/cgroup")).splitlines():
        _hid, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c.removeprefix("name=")] = path
    return out


def v2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup``, or on a hybrid host
    ``/sys/fs/cgroup/unified``), from /proc/self/mountinfo; None if it is not."""
    with contextlib.suppress(OSError):
        for line in read(Path("/proc/self/mountinfo")).splitlines():
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                return Path(left.split()[4])
    return None


def procs(d: Path) -> set[int]:
    """Thread-group ids in ``d`` and every cgroup beneath it."""
    pids: set[int] = set()
    for sub, _dirs, _files in os.walk(d):
        with contextlib.suppress(OSError):
            pids.update(int(x) for x in read(Path(sub) / "cgroup.procs").split())
    return pids


def live(pids: set[int]) -> set[int]:
    """Those of ``pids`` that are not zombies (a zombie waits for its parent to reap it)."""
    out = set()
    for pid in pids:
        try:
            stat = read(Path(f"/proc/{pid}/stat"))
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X"):
            out.add(pid)
    return out


def run_delay_ns(tasks_file: Path) -> int:
    """Nanoseconds the threads listed in ``tasks_file`` (a v1 ``tasks`` file) have waited on a
    run queue, runnable but not running, over their lives (``/proc/<tid>/schedstat``, 2nd
    field; Documentation/scheduler/sched-stats.rst). Threads gone meanwhile are left out, so
    the sum can go down. 0 if unreadable."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in read(tasks_file).split():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(read(Path(f"/proc/{tid}/schedstat")).split()[1])
    return total


def psi_some_total_us(path: Path) -> int | None:
    """The ``some`` line's ``total`` of a PSI file (``cpu.pressure``, ``memory.pressure``):
    microseconds at least one task waited, over the cgroup's life
    (Documentation/accounting/psi.rst). None if unreadable."""
    try:
        for line in read(path).splitlines():
            if line.startswith("some "):
                for field in line.split()[1:]:
                    if field.startswith("total="):
                        return int(field.removeprefix("total="))
    except (OSError, ValueError):
        return None
    return None


def kill_procs(d: Path) -> None:
    """SIGKILL every task in ``d`` and beneath it."""
    for pid in procs(d):
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
