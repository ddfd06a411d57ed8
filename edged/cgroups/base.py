"""The interface of the cgroups room: a :class:`Hierarchy` (where this daemon may make
cgroups, found once at start-up) makes a :class:`SandboxCgroup` per sandbox. Two
implementations, :mod:`.v1` (v1 controllers, and on a hybrid host the controller-less v2
hierarchy for cgroup BPF) and :mod:`.v2`; :mod:`.none` where no cgroup can be made.

Rules (from the host notes): never remount cgroups; create only beneath the cgroup that
``/proc/self/cgroup`` names for each controller; never write to a cgroup we did not create.
Our tree: ``<own cgroup>/<subdir>/<sandbox id>`` in each hierarchy. A sandbox's directory is
delegated to the sandbox's root uid (chown) so that sbx-init can make one cgroup per exec
beneath it for tree kills: freezer cgroups on v1, controller-less ones on v2, never memory
cgroups. A sandbox has one memory cgroup: the kernel gives every memory cgroup shrinker tables
sized by the number of superblocks on the host (1 KiB per 64 per NUMA node, mm/shrinker.c), so
the host's kernel memory grows with memory cgroups × superblocks, both proportional to the
sandboxes (see sbx-init's cgroup.c and the spawner's header).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import time
from pathlib import Path

from edged.cgroups import fs
from edged.datatypes import MemoryUsage, Resources
from edged.errors import BackendError

CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
#: Name prefix of cgroups made ahead for pooled spawners; no sandbox id starts with a dot.
POOL_PREFIX = ".pool-"


def swap_allowance(res: Resources, share: float) -> int:
    """cgroup v2 ``memory.swap.max`` of a sandbox: what it asked for (``swap_bytes``), and at
    least ``share`` × its memory limit so that reclaim can page its cold memory out (with 0,
    v2 swaps none of it). v1 needs none of this: its ``memory.memsw.limit_in_bytes`` caps
    memory and swap together, and paging out moves a charge from one to the other."""
    return max(res.swap_bytes, int(res.memory_bytes * share))


#: Seconds :meth:`SandboxCgroup.kill_workload` waits for the sandbox to freeze whole before
#: it kills what it lists all the same.
FREEZE_STEP_S = 1.0


class SandboxCgroup(abc.ABC):
    """The cgroup directories of one sandbox (they may not exist yet, or any more).

    ``version``: ``"v1" | "v2" | "none"``. ``dirs``: controller (``"v2"`` on v2) -> its
    directory, as facts for tools and tests. ``join``: the directories the spawner must still
    enter (a pooled spawner is in its cgroups already). ``bpf_dir``: the sandbox's own
    directory in the v2 hierarchy, where cgroup BPF programs attach and apply to its tasks
    only (None unless asked for at create, or on a host without cgroup v2).
    """

    version = "none"

    def __init__(self, dirs: dict[str, Path], bpf_dir: Path | None = None) -> None:
        self.dirs = dirs
        self.join: list[Path] = []
        self.bpf_dir = bpf_dir

    @abc.abstractmethod
    def sbx_init_dirs(self) -> dict[str, Path]:
        """The directories sbx-init makes its per-exec cgroups in: ``{"freezer", "memory"}``
        (v1) or ``{"v2"}``; the spawner's ``--cg-<key>`` options."""

    @abc.abstractmethod
    def freeze(self, frozen: bool, timeout_s: float = 5.0) -> None:
        """Freeze (``frozen``) or thaw every task of the sandbox; waits until the kernel
        reports the state. Raises BackendError if it does not within ``timeout_s``,
        InvalidState where the host gives the sandbox no freezer (:mod:`edged.cgroups.none`)."""

    @abc.abstractmethod
    def frozen(self) -> bool:
        """Whether the sandbox is frozen now (False when that cannot be read)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """``memory_bytes`` (current usage), ``cpu_usage_ns``, ``pids`` (tasks now); 0 for
        what cannot be read."""

    @abc.abstractmethod
    def memory_usage(self) -> MemoryUsage:
        """The sandbox's memory as its memory cgroup counts it (hierarchical: exec cgroups
        beneath included). Zeros for what cannot be read (a sandbox being torn down)."""

    def reclaim(self, nbytes: int) -> bool:
        """Proactive reclaim of ``nbytes`` through the cgroup (v2 ``memory.reclaim``: the
        kernel reclaims that much, anon to swap as ``memory.swap.max`` allows; v1
        ``memory.force_empty``: all it can; less being reclaimable is no error). False where
        the cgroup cannot (no memory cgroup, or a kernel without either file): page out per
        process then. Raises BackendError."""
        return False

    def memory_join(self) -> Path | None:
        """The file a helper process writes its own pid to so that the memory it allocates
        from then on (tmpfs pages of a file it writes into the upper, say) is charged to
        the sandbox: a process's allocations are charged to the memory cgroup it is in
        (mm/memcontrol.c), never to the owner of the filesystem. None without one."""
        return None

    def procs(self) -> list[int]:
        """Host pids of every process in the sandbox's cgroups (all levels), zombies left
        out."""
        return sorted(self._live_tasks())

    @abc.abstractmethod
    def set_qos(self, qos: str) -> None:
        """``best_effort``: the sandbox's CPU cgroup runs as SCHED_IDLE (``cpu.idle`` 1,
        Linux >= 5.15, v1 and v2): it gets only CPU time no normal task wants, and any normal
        task preempts it at wake-up; ``latency_sensitive``: normal (``cpu.idle`` 0). Silently
        nothing where the kernel has no ``cpu.idle``."""

    @abc.abstractmethod
    def oom_kills(self) -> int:
        """OOM kills counted in the sandbox's memory cgroup (0 when unreadable)."""

    @abc.abstractmethod
    def limit_counters(self) -> dict[str, int]:
        """Counters that grow when a limit is hit: ``pids_limit`` (forks refused at
        pids.max), ``cpu_throttled`` (periods throttled by the CPU quota), ``oom_kill``; 0
        for what cannot be read. Sources: cgroup-v1/pids.rst, cgroup-v2.rst (pids.events,
        cpu.stat), scheduler/sched-bwc.rst (nr_throttled)."""

    @abc.abstractmethod
    def unthrottle(self, leave_idle: bool = False) -> None:
        """Let the sandbox's tasks have CPU while they die: no CPU quota and the normal
        class, not SCHED_IDLE. A SIGKILLed task still runs its exit in the kernel, and a
        dying PID 1 waits for every task of its namespace; starved by a tiny quota or an
        idle class beside busy normal tasks, that took longer than any wait (issue 9).
        ``leave_idle``: also move the processes out of an idle parent class the sandbox's
        own settings cannot lift (costly: each move waits for an RCU grace period, so only
        for a sandbox slow to die). Best effort (a cgroup being removed may be gone);
        nothing where there is no CPU controller. Sources: scheduler/sched-bwc.rst (quota
        -1 or ``max``: unlimited), cpu.idle (Linux >= 5.15)."""

    @abc.abstractmethod
    def kill_all(self) -> None:
        """SIGKILL every task in the sandbox's cgroups (all levels), thawing what must be
        thawed for a kill to take."""

    @abc.abstractmethod
    def _thaw_after_kill(self) -> None:
        """Thaw what :meth:`kill_workload` froze (every level where freezing is per level)."""

    def kill_workload(self, keep_pid: int, timeout_s: float = 30.0) -> int:
        """SIGKILL every task of the sandbox but ``keep_pid`` (sbx-init, host pid), with
        the whole sandbox frozen while its tasks are listed and signalled, so that a fork
        bomb cannot add tasks between the listing and the kill; repeated until no task
        but ``keep_pid`` is left. A sandbox that does not freeze whole within a step
        (``FREEZE_STEP_S``; a throttled fork bomb on a loaded host: at load 40-100 the
        freezer had not reached FROZEN in 10 s and the kill failed, the sandbox left
        freezing) is killed all the same: its frozen tasks cannot fork, the others are
        caught by the next pass. Returns the number of processes killed. Raises
        BackendError if tasks are still left after ``timeout_s`` (thawed, either way),
        InvalidState where the host gives the sandbox no cgroup to list its tasks by."""
        deadline = time.monotonic() + timeout_s
        killed: set[int] = set()  # one killed but not yet gone is listed again next time
        while True:
            with contextlib.suppress(BackendError):  # not frozen whole yet: kill anyway
                self.freeze(True, timeout_s=min(FREEZE_STEP_S,
                                                max(0.1, deadline - time.monotonic())))
            try:
                left = self._live_tasks() - {keep_pid}
                for pid in left:
                    with contextlib.suppress(OSError):
                        os.kill(pid, 9)
                        killed.add(pid)
            finally:
                self._thaw_after_kill()
            if not left:
                return len(killed)
            if time.monotonic() > deadline:
                raise BackendError(f"{len(left)} processes still alive after {timeout_s} s "
                                   f"of killing")
            time.sleep(0.002)  # let the killed tasks exit before listing again

    def _live_tasks(self) -> set[int]:
        """Thread-group ids in every cgroup level of the sandbox, zombies left out (they
        wait for sbx-init to reap them)."""
        pids: set[int] = set()
        for d in set(self.dirs.values()):
            pids |= fs.procs(d)
        return fs.live(pids)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove every directory (deepest first). Idempotent.
        Raises BackendError if a cgroup stays busy for ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen: set[Path] = set()
        for d in [*self.dirs.values(), *([self.bpf_dir] if self.bpf_dir else [])]:
            if d in seen or not d.exists():
                continue
            seen.add(d)
            while True:
                try:
                    for sub, _dirs, _files in os.walk(d, topdown=False):
                        with contextlib.suppress(FileNotFoundError):
                            os.rmdir(sub)
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise BackendError(f"remove cgroup {d}: {exc.strerror}") from exc
                    self.kill_all()
                    if self.bpf_dir is not None:
                        fs.kill_procs(self.bpf_dir)
                    time.sleep(0.002)


class Hierarchy(abc.ABC):
    """Where this daemon makes sandbox cgroups: found at construction, beneath this
    process's own cgroups, in ``<subdir>`` (so several daemons can coexist).

    ``version``: ``"v1" | "v2" | "none"``. ``parents``: controller -> our directory holding
    the sandboxes' (made on first use). ``swap_accounting``: whether swap can be limited.
    ``swap_share``: on v2, the swap each sandbox may hold as a share of its memory limit
    (:func:`swap_allowance`). ``tree_kill``: how sbx-init kills an exec's tree here.
    """

    version = "none"
    tree_kill = "session sweep"

    def __init__(self, root: Path = CGROUP_ROOT, subdir: str = "edged",
                 swap_share: float = 1.0) -> None:
        self.root = root
        self.subdir = subdir
        self.swap_share = swap_share
        self.parents: dict[str, Path] = {}
        self.swap_accounting = False

    def _memory_parent(self) -> Path | None:
        """Our directory in the memory controller's hierarchy (None without one)."""
        return None

    def _cpu_parent(self) -> Path | None:
        """Our directory in the cpu controller's hierarchy (None without one)."""
        return None

    def features(self) -> dict[str, object]:
        """What ``GET /v1/node`` shows of the cgroups."""
        mem, cpu = self._memory_parent(), self._cpu_parent()
        return {
            "cgroup": self.version,
            "cgroup_parents": {k: str(v) for k, v in self.parents.items()},
            "swap_accounting": self.swap_accounting,
            # v2's proactive reclaim (Linux >= 5.19), v1's memory.force_empty; without
            # either, reclaim pages out per process (process_madvise)
            "memory_reclaim": bool(mem and any((mem.parent / f).exists() for f in (
                "memory.reclaim", "memory.force_empty"))),
            "cpu_idle": bool(cpu and (cpu.parent / "cpu.idle").exists()),
        }

    def set_memory_limit(self, nbytes: int) -> None:
        """Cap the memory of all sandboxes together (our parent memory cgroup): the backstop
        that keeps the host's share free whatever the sandboxes do, reclaim (to swap) and
        then OOM kills staying among them. 0: no cap. Raises BackendError."""
        limit = self._memory_limit_file()
        if limit is None:
            return
        path, unlimited = limit
        try:
            self._ensure_parents()
            fs.write(path, str(nbytes) if nbytes else unlimited)
        except OSError as exc:
            raise BackendError(f"cgroup memory limit of all sandboxes: {exc}") from exc

    def _memory_limit_file(self) -> tuple[Path, str] | None:
        """Our parent's memory limit file and the value that means no limit."""
        return None

    def _ensure_parents(self) -> None:
        """Make our parent directories (and what they need) if they are missing."""
        return None

    def totals(self) -> MemoryUsage:
        """Every sandbox's memory together (our parent cgroup, hierarchical)."""
        return MemoryUsage()

    @abc.abstractmethod
    def path_of(self, sandbox_id: str) -> SandboxCgroup:
        """The (possibly not existing) cgroup of a sandbox."""

    @abc.abstractmethod
    def create(self, sandbox_id: str, res: Resources, root_uid: int, *,
               qos: str = "best_effort", bpf: bool = False) -> SandboxCgroup:
        """Make the sandbox's cgroups with the limits of ``res`` and the CPU class ``qos``
        (:meth:`SandboxCgroup.set_qos`), delegated to host uid ``root_uid`` (sandbox root);
        with ``bpf`` also its own v2 directory (``bpf_dir``) for cgroup BPF, which the spawner
        then joins. Raises BackendError (the half-made cgroups removed)."""

    def reclass(self, cg: SandboxCgroup, qos: str) -> None:
        """Put a sandbox's running tasks in CPU class ``qos`` (as :meth:`create` would have),
        its limits kept: e.g. a best-effort microVM's VMM runs normal while it starts (a
        SCHED_IDLE VMM on a busy host was starved past every bound of its start) and idle
        after. Here the class is the cgroup's own setting (:meth:`SandboxCgroup.set_qos`).
        Raises BackendError."""
        try:
            cg.set_qos(qos)
        except OSError as exc:
            raise BackendError(f"cgroup {cg.dirs}: CPU class {qos}: {exc}") from exc

    def create_pooled(self, tag: str, root_uid: int, *,
                      qos: str = "best_effort") -> SandboxCgroup | None:
        """Cgroups ``.pool-<tag>`` for a pooled spawner, made ahead of demand without limits
        (a move into a cgroup waits for an RCU grace period when none happened lately:
        milliseconds, kept off the create), which :meth:`claim` gives a sandbox later: one
        of CPU class ``qos`` without moving a task (another class may need a move).
        None where cgroups cannot be handed on so (v2 cannot rename a cgroup)."""
        return None

    def claim(self, pooled: SandboxCgroup, sandbox_id: str, res: Resources, *,
              qos: str = "best_effort", bpf: bool = False) -> SandboxCgroup:
        """Hand pooled cgroups (:meth:`create_pooled`) to ``sandbox_id``, their tasks staying
        in them, with the limits of ``res`` and CPU class ``qos`` (and a ``bpf_dir``, the one
        directory left in ``join``). Raises BackendError (nothing changed)."""
        raise BackendError(f"cgroup {self.version}: no pooled cgroups to claim")

    def bpf_dir(self) -> Path | None:
        """The v2 directory every sandbox cgroup of ours is beneath (made if missing), where
        node-wide cgroup BPF programs attach; None without a v2 hierarchy."""
        return None

    def _bpf_parent(self) -> Path | None:
        """Where the sandboxes' own v2 directories go (not made here)."""
        return None

    def _extra_parents(self) -> list[Path]:
        """Our directories beyond ``parents`` that hold sandbox cgroups."""
        bpf = self._bpf_parent()
        return [bpf] if bpf else []

    def all_parents(self) -> list[Path]:
        """Every directory of ours that holds sandbox cgroups (``parents``, and where the
        implementation keeps some elsewhere: v2 BPF directories, v1 best-effort cpu)."""
        return [*self.parents.values(), *self._extra_parents()]

    def existing(self) -> set[str]:
        """Sandbox ids that have a cgroup directory in any of our hierarchies."""
        out: set[str] = set()
        for p in self.all_parents():
            with contextlib.suppress(FileNotFoundError):
                out.update(e.name for e in os.scandir(p) if e.is_dir())
        return out

    def prune(self) -> None:
        """Remove our parent cgroups if they hold no sandbox (rmdir refuses a busy one)."""
        for p in self.all_parents():
            with contextlib.suppress(OSError):
                p.rmdir()
