"""What the host's kernel says about memory, pressure and processes, read from procfs.

Pure readers with their paths as arguments (tests give files of their own). Units: bytes,
seconds, percentages as the kernel prints them (PSI ``avg*`` are percent of wall time).

Sources: Documentation/filesystems/proc.rst (``/proc/meminfo``, ``/proc/vmstat``,
``/proc/loadavg``), Documentation/accounting/psi.rst (the ``some``/``full`` line format, also
of cgroup v2 ``memory.pressure``/``cpu.pressure``).
"""

from __future__ import annotations

from dataclasses import dataclass

MEMINFO = "/proc/meminfo"
VMSTAT = "/proc/vmstat"
PRESSURE = "/proc/pressure"


def meminfo(path: str = MEMINFO) -> dict[str, int]:
    """``/proc/meminfo`` as bytes (``MemAvailable``, ``SUnreclaim``, ...); fields without a
    ``kB`` unit (``HugePages_Total``) as plain counts. Raises OSError if unreadable."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if not parts:
                continue
            n = int(parts[0])
            out[key] = n * 1024 if len(parts) > 1 and parts[1] == "kB" else n
    return out


def vmstat(path: str = VMSTAT) -> dict[str, int]:
    """``/proc/vmstat`` counters (pages or events, as the kernel names them)."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(" ")
            if value.strip().lstrip("-").isdigit():
                out[key] = int(value)
    return out


@dataclass(frozen=True)
class PsiLine:
    """One ``some`` or ``full`` line: share of wall time (percent) over 10/60/300 s, and the
    total stall time in microseconds since boot (or since the cgroup was made)."""

    avg10: float = 0.0
    avg60: float = 0.0
    avg300: float = 0.0
    total_us: int = 0


@dataclass(frozen=True)
class Psi:
    """A PSI file: ``some`` (at least one task stalled) and ``full`` (all non-idle tasks
    stalled; the CPU file has ``full`` since 5.13, all zero at the system level)."""

    some: PsiLine = PsiLine()
    full: PsiLine = PsiLine()

    def to_json(self) -> dict[str, dict[str, float]]:
        """``{"some": {"avg10", "avg60", "avg300", "total_us"}, "full": {...}}``."""
        return {k: {"avg10": v.avg10, "avg60": v.avg60, "avg300": v.avg300,
                    "total_us": v.total_us}
                for k, v in (("some", self.some), ("full", self.full))}


def parse_psi(text: str) -> Psi:
    """Parse ``some avg10=0.12 avg60=... avg300=... total=N`` / ``full ...`` lines. Raises
    ValueError on a line of another shape."""
    lines: dict[str, PsiLine] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, *fields = line.split()
        if kind not in ("some", "full"):
            raise ValueError(f"PSI line {line!r}: not some/full")
        kv = dict(f.split("=", 1) for f in fields)
        lines[kind] = PsiLine(float(kv["avg10"]), float(kv["avg60"]), float(kv["avg300"]),
                              int(kv["total"]))
    return Psi(lines.get("some", PsiLine()), lines.get("full", PsiLine()))


def read_psi(path: str) -> Psi | None:
    """The PSI file at ``path`` (``/proc/pressure/memory``, ``<cgroup>/memory.pressure``), or
    None where the kernel has no PSI (unbuilt, or booted with ``psi=0``: reads fail with
    EOPNOTSUPP)."""
    try:
        with open(path) as f:
            return parse_psi(f.read())
    except (OSError, ValueError):
        return None


def threads(path: str = "/proc/loadavg") -> int:
    """Kernel scheduling entities (threads) that exist now: the denominator of the 4th field
    of ``/proc/loadavg``. Raises OSError/ValueError."""
    with open(path) as f:
        return int(f.read().split()[3].split("/")[1])


def pid_max(path: str = "/proc/sys/kernel/pid_max") -> int:
    """``kernel.pid_max``: the most pids (threads) the host can have at once."""
    with open(path) as f:
        return int(f.read())
