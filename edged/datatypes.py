"""The plain data the backends' contract (:mod:`edged.backends.base`, which re-exports it)
shares with the rooms beneath the backends: a sandbox's limits (:class:`Resources`), its
memory as its cgroup counts it (:class:`MemoryUsage`), how an exec ended (:class:`ExecEnd`)
and where security events go (:data:`EventSink`). Here so that the sbx-init client
(:mod:`edged.sbxinit`) and the cgroups (:mod:`edged.cgroups`), which every backend uses,
import nothing of the backends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Where a backend sends security events: ``sink(sandbox_id, kind, *, pid=, process=,
#: syscall=, path=, address=, detail=)``, the signature of
#: :meth:`edged.security.ledger.Ledger.record` (what the daemon passes).
EventSink = Callable[..., object]


@dataclass(frozen=True)
class Resources:
    """Limits of one sandbox.

    ``cpus``: CPU quota in cores (cgroup cfs quota/period; the weight is derived from it).
    ``memory_bytes``: memory limit. ``swap_bytes``: extra swap allowed beyond memory.
    ``pids``: max tasks. ``disk_bytes``: size limit of the writable upper layer.
    ``memory_request_bytes``: what the sandbox is expected to use soon after it starts (its
    request; it may burst to ``memory_bytes``, its limit): the node's admission sets this
    much aside until the sandbox's own use is measured (:mod:`edged.node.admission`).
    """

    cpus: float = 1.0
    memory_bytes: int = 512 << 20
    swap_bytes: int = 0
    pids: int = 1024
    disk_bytes: int = 1 << 30
    memory_request_bytes: int = 32 << 20


@dataclass(frozen=True)
class MemoryUsage:
    """One sandbox's memory as its memory cgroup counts it (bytes; counters cumulative).

    ``resident_bytes``: charged now (anon + page cache + shmem + kernel objects charged);
    ``anon_bytes``, ``file_bytes`` (page cache, shmem excluded), ``shmem_bytes`` (tmpfs: the
    upper and /dev/shm) of it; ``swap_bytes``: pages of it in swap; ``major_faults``: page
    faults that had to read (from swap, or from a layer); ``cpu_usage_ns``: CPU time used;
    ``cpu_wait_ns``: time its tasks were runnable but waited for a CPU (a CPU-starved
    sandbox uses little CPU and is still busy; 0 where unknown).
    """

    resident_bytes: int = 0
    anon_bytes: int = 0
    file_bytes: int = 0
    shmem_bytes: int = 0
    swap_bytes: int = 0
    major_faults: int = 0
    cpu_usage_ns: int = 0
    cpu_wait_ns: int = 0


@dataclass(frozen=True)
class ExecEnd:
    """How an exec ended.

    ``reason``: ``"exited" | "signalled" | "timeout" | "oom" | "output_limit" | "killed"``.
    ``exit_code``: set when reason is ``exited``, None otherwise (enforced here); ``signal``:
    the signal that killed the exec's main process, when one did. ``duration_s``: wall time.
    ``peak_memory_bytes``: when known. ``message``: what more there is to say of this end,
    when there is something (None otherwise): e.g. a ``timeout`` ended by the daemon because
    the killed process could not be reaped (see :data:`edged.sbxinit.client.END_GRACE_S`).
    """

    reason: str
    exit_code: int | None
    signal: int | None
    duration_s: float
    peak_memory_bytes: int | None
    message: str | None = None

    def __post_init__(self) -> None:
        # The contract, whoever reports the end: an exec that did not end by its own exit
        # has no exit code (sbx-init reports the main process's status with an "oom" end
        # when another process of its tree was killed: `sh -c 'dd ...; echo'` said
        # oom with exit_code 0).
        if self.reason != "exited" and self.exit_code is not None:
            object.__setattr__(self, "exit_code", None)
