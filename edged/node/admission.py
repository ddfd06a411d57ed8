"""Admission of sandboxes against node capacity × overcommit.

CPU is overcommitted hard (DSec: ~90% of sandboxes use <=5% of the CPU they request); memory
only modestly, since an over-full node ends in a host OOM. A request that does not fit is
refused with :class:`~edged.errors.CapacityExhausted` carrying ``retry_after``, never queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edged.backends.base import Resources
from edged.errors import CapacityExhausted


@dataclass
class Capacity:
    """Totals (cores, bytes) and overcommit ratios; tracks what admitted sandboxes hold."""

    cpus: float
    memory_bytes: int
    cpu_overcommit: float
    memory_overcommit: float
    max_sandboxes: int
    retry_after_s: float = 1.0
    _held: dict[str, Resources] = field(default_factory=dict)

    @property
    def allocated_cpus(self) -> float:
        """Cores promised to admitted sandboxes."""
        return sum(r.cpus for r in self._held.values())

    @property
    def allocated_memory(self) -> int:
        """Bytes (memory + swap) promised to admitted sandboxes."""
        return sum(r.memory_bytes + r.swap_bytes for r in self._held.values())

    def reserve(self, sandbox_id: str, res: Resources) -> None:
        """Hold ``res`` for ``sandbox_id`` or raise :class:`CapacityExhausted` saying which
        limit is hit. Idempotent for an id already held (re-adoption)."""
        if sandbox_id in self._held:
            return
        limit_cpu = self.cpus * self.cpu_overcommit
        limit_mem = self.memory_bytes * self.memory_overcommit
        why = None
        if len(self._held) + 1 > self.max_sandboxes:
            why = f"node holds its maximum of {self.max_sandboxes} sandboxes"
        elif self.allocated_cpus + res.cpus > limit_cpu + 1e-9:
            why = (
                f"cpus: {self.allocated_cpus:g} allocated + {res.cpus:g} requested > "
                f"{limit_cpu:g} ({self.cpus:g} cores × {self.cpu_overcommit:g})"
            )
        elif self.allocated_memory + res.memory_bytes + res.swap_bytes > limit_mem:
            why = (
                f"memory: {self.allocated_memory} allocated + "
                f"{res.memory_bytes + res.swap_bytes} requested > {int(limit_mem)} bytes "
                f"({self.memory_bytes} × {self.memory_overcommit:g})"
            )
        if why:
            raise CapacityExhausted(f"capacity exhausted: {why}", retry_after=self.retry_after_s)
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
                "sandboxes": len(self._held),
            },
        }
