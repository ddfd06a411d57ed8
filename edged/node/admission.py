"""Admission of sandboxes on measured use.

A sandbox asks for little (``memory_request_bytes``) and may burst to its limit
(``memory_bytes``); most sandboxes sit idle most of their lives (DSec: ~90% average ≤ 5% of
the CPU they request), and idle memory goes to compressed swap (:mod:`edged.node.reclaim`).
So the node admits against what the host really has, not against the sum of limits:

- **memory**: headroom = the host's ``MemAvailable`` less a reserve kept for the host
  (``reserve_bytes``), plus what reclaim can get back now (idle sandboxes not yet reclaimed),
  less what recently admitted sandboxes asked for and have not used yet (their requests
  over ``window_s``, less the memory the host lost meanwhile). A create needs its request
  plus the kernel memory a sandbox costs the host (measured: :class:`KernelOverhead`). With
  a configured capacity below the host's (``Config.memory_bytes``), the sandboxes' own use
  (their cgroups, the zram holding their pages, their kernel objects) is held within it too.
- **pressure**: no create while memory PSI ``full avg10`` is above ``memory_pressure_limit``
  percent (tasks are already waiting on reclaim: more would thrash), nor, if set, while CPU
  PSI ``some avg10`` is above ``cpu_pressure_limit``.
- **processes**: no create once the host's threads come within ``pid_reserve`` of
  ``kernel.pid_max``.
- **counts and ratios**: ``max_sandboxes``; and, where configured (> 0), the sum of CPU and
  memory *limits* against capacity × overcommit.

A refusal is :class:`~edged.errors.CapacityExhausted` with the reason and ``retry_after``,
never a queue: for memory, the time reclaim at its recent rate (``reclaim_rate()``, bytes a
second) takes to free what is missing (at least ``reclaim_retry_s``, at most
``max_retry_s``); ``reclaim_retry_s`` when reclaim has idle memory to take but no rate yet.
A client retrying after it is paced, not walled, while reclaim catches up. Memory a backend
holds ahead of demand (``spares``: e.g. the microVM pool's clones started ahead) is part of
what the host has used, shown as ``spare_bytes``; a create short of headroom first has it
given back (:meth:`SpareHolder.drain_pool`) and counts it as headroom. Behind admission, the
memory of all sandboxes together is capped by their parent cgroup (the backend's
``set_memory_limit``), so a sandbox that bursts after admission is reclaimed or OOM-killed
among the sandboxes, never the host.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from edged.backends.base import Resources
from edged.errors import CapacityExhausted
from edged.node import hostmem

MiB = 1 << 20


@runtime_checkable
class SpareHolder(Protocol):
    """A backend holding memory ahead of demand that it can give back at once."""

    def pool_bytes(self) -> int:
        """Bytes it holds ahead of demand now."""
        ...

    def drain_pool(self) -> int:
        """Give it back now (ending what holds it) and hold off a while; returns how many
        things it ended."""
        ...


@dataclass
class Capacity:
    """Totals (cores, bytes) and overcommit ratios of *limits* (0: no cap); tracks what admitted
    sandboxes hold."""

    cpus: float
    memory_bytes: int
    cpu_overcommit: float
    memory_overcommit: float
    max_sandboxes: int
    retry_after_s: float = 1.0
    _held: dict[str, Resources] = field(default_factory=dict)

    @property
    def allocated_cpus(self) -> float:
        """Cores of CPU limits of admitted sandboxes."""
        return sum(r.cpus for r in self._held.values())

    @property
    def allocated_memory(self) -> int:
        """Bytes (memory + swap limits) of admitted sandboxes."""
        return sum(r.memory_bytes + r.swap_bytes for r in self._held.values())

    @property
    def requested_memory(self) -> int:
        """Bytes of memory requests of admitted sandboxes."""
        return sum(r.memory_request_bytes for r in self._held.values())

    @property
    def count(self) -> int:
        """Sandboxes held."""
        return len(self._held)

    def holds(self, sandbox_id: str) -> bool:
        """Whether ``sandbox_id`` is admitted."""
        return sandbox_id in self._held

    def check(self, res: Resources) -> str | None:
        """Why ``res`` does not fit the count and ratio limits, or None."""
        if len(self._held) + 1 > self.max_sandboxes:
            return f"node holds its maximum of {self.max_sandboxes} sandboxes"
        limit_cpu = self.cpus * self.cpu_overcommit
        if self.cpu_overcommit > 0 and self.allocated_cpus + res.cpus > limit_cpu + 1e-9:
            return (f"cpus: {self.allocated_cpus:g} allocated + {res.cpus:g} requested > "
                    f"{limit_cpu:g} ({self.cpus:g} cores × {self.cpu_overcommit:g})")
        limit_mem = self.memory_bytes * self.memory_overcommit
        want = res.memory_bytes + res.swap_bytes
        if self.memory_overcommit > 0 and self.allocated_memory + want > limit_mem:
            return (f"memory: {self.allocated_memory} allocated + {want} requested > "
                    f"{int(limit_mem)} bytes ({self.memory_bytes} × "
                    f"{self.memory_overcommit:g})")
        return None

    def reserve(self, sandbox_id: str, res: Resources) -> None:
        """Hold ``res`` for ``sandbox_id`` or raise :class:`CapacityExhausted` saying which
        limit is hit. Idempotent for an id already held (re-adoption)."""
        if sandbox_id in self._held:
            return
        why = self.check(res)
        if why:
            raise CapacityExhausted(f"capacity exhausted: {why}", retry_after=self.retry_after_s)
        self._held[sandbox_id] = res

    def hold(self, sandbox_id: str, res: Resources) -> None:
        """Record ``res`` for ``sandbox_id`` without any check (an adopted sandbox runs
        already)."""
        self._held[sandbox_id] = res

    def release(self, sandbox_id: str) -> None:
        """Give back what ``sandbox_id`` held (no-op if nothing)."""
        self._held.pop(sandbox_id, None)

    def to_json(self) -> dict[str, Any]:
        """Capacity and allocations for ``GET /v1/node``."""
        return {
            "capacity": {
                "cpus": self.cpus,
                "memory_bytes": self.memory_bytes,
                "cpu_overcommit": self.cpu_overcommit,
                "memory_overcommit": self.memory_overcommit,
                "max_sandboxes": self.max_sandboxes,
            },
            "allocated": {
                "cpus": self.allocated_cpus,
                "memory_bytes": self.allocated_memory,
                "memory_request_bytes": self.requested_memory,
                "sandboxes": len(self._held),
            },
        }


def kernel_bytes(mi: dict[str, int]) -> int:
    """Host kernel memory from ``/proc/meminfo``: slab, kernel stacks, page tables, per-CPU."""
    return sum(mi.get(k, 0) for k in ("Slab", "KernelStack", "PageTables", "SecPageTables",
                                      "Percpu"))


@dataclass
class KernelOverhead:
    """Host kernel memory per sandbox, measured: (kernel memory now − at a baseline) / (the
    sandboxes now − at that baseline), smoothed; ``default`` until ``min_sandboxes`` more
    than at the baseline exist. It grows with N where the kernel's per-memory-cgroup tables
    grow with the number of superblocks (see README, "Density"), which is why it is measured
    rather than assumed."""

    default: int = MiB
    min_sandboxes: int = 16
    baseline: tuple[int, int] | None = None  # (sandboxes, kernel bytes)
    value: int = 0
    alpha: float = 0.2

    def observe(self, sandboxes: int, kernel: int) -> None:
        """A sample: ``sandboxes`` of ours exist and the host's kernel holds ``kernel`` bytes."""
        if self.baseline is None or sandboxes < self.baseline[0]:
            self.baseline = (sandboxes, kernel)
            return
        n = sandboxes - self.baseline[0]
        if n < self.min_sandboxes:
            return
        est = max(0, (kernel - self.baseline[1]) // n)
        self.value = est if self.value == 0 else int(self.value + self.alpha * (est - self.value))

    @property
    def per_sandbox(self) -> int:
        """Bytes per sandbox (the default until measured)."""
        return self.value or self.default


@dataclass(frozen=True)
class Usage:
    """The sandboxes' own use, as the backend and the swap see it (bytes): charged to their
    cgroups, held compressed in our zram device, and the kernel objects not charged."""

    resident: int = 0
    swap: int = 0
    zram: int = 0


@dataclass
class Admission:
    """The measured part of admission (see the module docstring). ``usage()`` returns the
    sandboxes' :class:`Usage`; ``reclaimable()`` what reclaim can free now; ``swap_free()``
    bytes of swap left to page into (None: unknown). Files read are injectable for tests."""

    capacity: Capacity
    reserve_bytes: int
    memory_pressure_limit: float = 10.0
    cpu_pressure_limit: float = 0.0
    window_s: float = 10.0
    pid_reserve: int = 1024
    pids_per_sandbox: int = 8
    overhead: KernelOverhead = field(default_factory=KernelOverhead)
    usage: Callable[[], Usage] = Usage
    reclaimable: Callable[[], int] = lambda: 0
    reclaim_rate: Callable[[], float] = lambda: 0.0
    reclaim_retry_s: float = 2.0
    max_retry_s: float = 30.0
    meminfo_path: str = hostmem.MEMINFO
    pressure_dir: str = hostmem.PRESSURE
    loadavg_path: str = "/proc/loadavg"
    pid_max_path: str = "/proc/sys/kernel/pid_max"
    clock: Callable[[], float] = time.monotonic
    #: backends holding memory ahead of demand (see the module docstring)
    spares: list[SpareHolder] = field(default_factory=list)
    #: admissions within ``window_s``: (when, sandbox id, its request, MemAvailable then)
    _recent: collections.deque[tuple[float, str, int, int]] = field(
        default_factory=collections.deque)

    # -- what the host has ----------------------------------------------------------------

    def _pending(self, now: float, avail: int) -> int:
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        if not self._recent:
            return 0
        asked = sum(r for _t, _s, r, _a in self._recent)
        realized = max(0, self._recent[0][3] - avail)
        return max(0, asked - realized)

    def snapshot(self) -> dict[str, Any]:
        """Memory, pressure and headroom now, in bytes and PSI percent: what ``GET /v1/node``
        reports and admission decides on."""
        now = self.clock()
        mi = hostmem.meminfo(self.meminfo_path)
        avail, total = mi.get("MemAvailable", 0), mi.get("MemTotal", 0)
        self.overhead.observe(self.capacity.count, kernel_bytes(mi))
        per = self.overhead.per_sandbox
        use = self.usage()
        n = self.capacity.count
        cap_total = min(total, self.capacity.memory_bytes) if self.capacity.memory_bytes else total
        host_room = avail - self.reserve_bytes
        if cap_total < total:  # a capacity of its own: the sandboxes' use stays within it
            used = use.resident + use.zram + n * per
            host_room = min(host_room, cap_total - used)
        pending = self._pending(now, avail)
        reclaimable = max(0, self.reclaimable())
        headroom = host_room - pending + reclaimable
        psi_mem = hostmem.read_psi(self.pressure_dir + "/memory")
        psi_cpu = hostmem.read_psi(self.pressure_dir + "/cpu")
        unit = self.capacity_unit()
        return {
            "memory": {
                "total_bytes": total, "available_bytes": avail,
                "capacity_bytes": cap_total, "reserve_bytes": self.reserve_bytes,
                "sandboxes_resident_bytes": use.resident, "sandboxes_swap_bytes": use.swap,
                "zram_bytes": use.zram, "kernel_bytes": kernel_bytes(mi),
                "kernel_per_sandbox_bytes": per, "pending_bytes": pending,
                "reclaimable_bytes": reclaimable, "headroom_bytes": headroom,
                "spare_bytes": sum(h.pool_bytes() for h in self.spares),
            },
            "pressure": {"memory": psi_mem.to_json() if psi_mem else None,
                         "cpu": psi_cpu.to_json() if psi_cpu else None},
            "free": {
                "sandbox_bytes": unit,
                "sandboxes": max(0, headroom // unit) if unit > 0 else 0,
                "max_sandboxes": max(0, self.capacity.max_sandboxes - n),
            },
        }

    def capacity_unit(self, request: int | None = None) -> int:
        """Bytes one more sandbox takes at admission: its request (default: the median
        request held now, else 32 MiB) plus the kernel overhead per sandbox."""
        if request is None:
            reqs = sorted(r.memory_request_bytes for r in self.capacity._held.values())
            request = reqs[len(reqs) // 2] if reqs else 32 * MiB
        return request + self.overhead.per_sandbox

    # -- the decision ---------------------------------------------------------------------

    def _refuse(self, why: str, retry: float | None = None) -> CapacityExhausted:
        return CapacityExhausted(f"capacity exhausted: {why}",
                                 retry_after=retry or self.capacity.retry_after_s)

    def admit(self, sandbox_id: str, res: Resources) -> None:
        """Admit ``res`` for ``sandbox_id`` (held in :attr:`capacity`) or raise
        :class:`CapacityExhausted` naming the first limit it hits. Idempotent for an id
        already held."""
        if self.capacity.holds(sandbox_id):
            return
        why = self.capacity.check(res)
        if why:
            raise self._refuse(why)
        try:
            busy = hostmem.threads(self.loadavg_path)
            limit = hostmem.pid_max(self.pid_max_path) - self.pid_reserve
        except (OSError, ValueError, IndexError):
            busy, limit = 0, 1 << 30
        if busy + self.pids_per_sandbox > limit:
            raise self._refuse(f"pids: {busy} threads on the host, kernel.pid_max less "
                               f"{self.pid_reserve} kept for it is {limit}")
        psi_mem = hostmem.read_psi(self.pressure_dir + "/memory")
        if psi_mem and self.memory_pressure_limit > 0 and \
                psi_mem.full.avg10 > self.memory_pressure_limit:
            raise self._refuse(f"memory pressure: tasks stalled {psi_mem.full.avg10:.1f}% of "
                               f"the last 10 s (limit {self.memory_pressure_limit:g}%)")
        if self.cpu_pressure_limit > 0:
            psi_cpu = hostmem.read_psi(self.pressure_dir + "/cpu")
            if psi_cpu and psi_cpu.some.avg10 > self.cpu_pressure_limit:
                raise self._refuse(f"cpu pressure: tasks waited {psi_cpu.some.avg10:.1f}% of "
                                   f"the last 10 s (limit {self.cpu_pressure_limit:g}%)")
        snap = self.snapshot()["memory"]
        need = res.memory_request_bytes + snap["kernel_per_sandbox_bytes"]
        if snap["headroom_bytes"] < need and snap["spare_bytes"] > 0:
            for h in self.spares:  # short: what is held ahead of demand goes first
                h.drain_pool()
            snap["headroom_bytes"] += snap["spare_bytes"]
        if snap["headroom_bytes"] < need:
            mib = 1 / MiB
            retry = self._memory_retry(need - snap["headroom_bytes"],
                                       snap["reclaimable_bytes"])
            raise self._refuse(
                f"memory: need {need * mib:.1f} MiB (request "
                f"{res.memory_request_bytes * mib:.1f} + kernel "
                f"{snap['kernel_per_sandbox_bytes'] * mib:.2f} per sandbox), headroom "
                f"{snap['headroom_bytes'] * mib:.1f} MiB (available "
                f"{snap['available_bytes'] * mib:.0f} of capacity "
                f"{snap['capacity_bytes'] * mib:.0f}, reserve {self.reserve_bytes * mib:.0f}, "
                f"pending {snap['pending_bytes'] * mib:.0f}, reclaimable "
                f"{snap['reclaimable_bytes'] * mib:.0f})", retry)
        self.capacity.hold(sandbox_id, res)
        self._recent.append((self.clock(), sandbox_id, res.memory_request_bytes,
                             snap["available_bytes"]))

    def _memory_retry(self, missing: int, reclaimable: int) -> float | None:
        """Seconds until reclaim, at its recent rate, frees ``missing`` bytes; None (the
        default Retry-After) when reclaim neither runs nor has idle memory to take."""
        rate = self.reclaim_rate()
        if rate > 0:
            return min(self.max_retry_s, max(self.reclaim_retry_s, missing / rate))
        return self.reclaim_retry_s if reclaimable > 0 else None

    def release(self, sandbox_id: str) -> None:
        """Give back what ``sandbox_id`` held; its request is no longer pending (a sandbox
        deleted within the window had kept it set aside: create/delete cycles faster than
        ``window_s`` / request came to refuse every create)."""
        self.capacity.release(sandbox_id)
        if any(s == sandbox_id for _t, s, _r, _a in self._recent):
            self._recent = collections.deque(e for e in self._recent if e[1] != sandbox_id)
