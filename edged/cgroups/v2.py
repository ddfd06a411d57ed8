"""cgroup v2 sandbox cgroups: one directory in the unified hierarchy, with the cpu, memory
and pids controllers enabled for it; sbx-init (its cgroup namespace's root) and, beneath
it, sbx-init's per-exec cgroups and the ``init`` leaf the daemon's file helper joins.

Sources: Documentation/admin-guide/cgroup-v2.rst (cpu.max, cpu.weight, memory.max,
memory.swap.max, pids.max, cgroup.freeze, cgroup.events, cgroup.kill, delegation).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from edged.cgroups import fs
from edged.cgroups.base import (
    CFS_PERIOD_US,
    CGROUP_ROOT,
    Hierarchy,
    SandboxCgroup,
    swap_allowance,
)
from edged.datatypes import MemoryUsage, Resources
from edged.errors import BackendError

#: The leaf of its own cgroup a daemon moves its cgroup's processes into before it enables
#: controllers for the sandboxes ("no internal processes").
DAEMON_LEAF = "daemon"


def _controls(d: Path) -> list[str]:
    """The controllers cgroup ``d`` enables for its children ([] if unreadable)."""
    try:
        return fs.read(d / "cgroup.subtree_control").split()
    except OSError:
        return []


class V2Cgroup(SandboxCgroup):
    """A sandbox's directory in the unified hierarchy (``dirs["v2"]``, also its
    ``bpf_dir``)."""

    version = "v2"

    @property
    def dir(self) -> Path:
        return self.dirs["v2"]

    def sbx_init_dirs(self) -> dict[str, Path]:
        return {"v2": self.dir}

    def memory_join(self) -> Path | None:
        return self.dir / "init" / "cgroup.procs"  # "no internal processes": the leaf

    def freeze(self, frozen: bool, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        fs.write(self.dir / "cgroup.freeze", "1" if frozen else "0")
        want_line = f"frozen {1 if frozen else 0}"
        while want_line not in fs.read(self.dir / "cgroup.events"):
            if time.monotonic() > deadline:
                raise BackendError(f"cgroup {self.dir}: did not reach {want_line}")
            time.sleep(0.001)

    def frozen(self) -> bool:
        try:
            return "frozen 1" in fs.read(self.dir / "cgroup.events")
        except OSError:
            return False

    def stats(self) -> dict[str, int]:
        out = {"memory_bytes": 0, "cpu_usage_ns": 0, "pids": 0}
        with contextlib.suppress(OSError, ValueError):
            out["memory_bytes"] = int(fs.read(self.dir / "memory.current"))
            out["cpu_usage_ns"] = fs.key(self.dir / "cpu.stat", "usage_usec") * 1000
            out["pids"] = int(fs.read(self.dir / "pids.current"))
        return out

    def memory_usage(self) -> MemoryUsage:
        """``memory.current``, ``memory.stat``, ``memory.swap.current``; the CPU wait from
        ``cpu.pressure`` (``some`` total: wall time at least one of its tasks was runnable
        and not running; Documentation/accounting/psi.rst)."""
        try:
            st = fs.flat_keyed(self.dir / "memory.stat")
            swap = 0
            with contextlib.suppress(OSError, ValueError):
                swap = int(fs.read(self.dir / "memory.swap.current"))
            wait = (fs.psi_some_total_us(self.dir / "cpu.pressure") or 0) * 1000
            shmem = st.get("shmem", 0)
            return MemoryUsage(
                resident_bytes=int(fs.read(self.dir / "memory.current")),
                anon_bytes=st.get("anon", 0),
                file_bytes=max(0, st.get("file", 0) - shmem),
                shmem_bytes=shmem,
                swap_bytes=swap,
                major_faults=st.get("pgmajfault", 0),
                cpu_usage_ns=fs.key(self.dir / "cpu.stat", "usage_usec") * 1000,
                cpu_wait_ns=wait)
        except (OSError, ValueError):
            return MemoryUsage()

    def reclaim(self, nbytes: int) -> bool:
        if not (self.dir.parent / "memory.reclaim").exists():
            return False
        if nbytes <= 0:
            return True
        try:
            fs.write(self.dir / "memory.reclaim", str(nbytes))
        except OSError as exc:
            if exc.errno != errno.EAGAIN:  # less was reclaimable
                raise BackendError(f"cgroup {self.dir}: memory.reclaim: {exc.strerror}") from exc
        return True

    def set_qos(self, qos: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.write(self.dir / "cpu.idle", "1" if qos == "best_effort" else "0")

    def unthrottle(self, leave_idle: bool = False) -> None:
        """``cpu.max`` max, ``cpu.idle`` 0 (on every level: exec cgroups inherit them)."""
        for sub, _dirs, _files in os.walk(self.dir):
            with contextlib.suppress(OSError):
                fs.write(Path(sub) / "cpu.max", "max")
            with contextlib.suppress(OSError):
                fs.write(Path(sub) / "cpu.idle", "0")

    def oom_kills(self) -> int:
        try:
            return fs.key(self.dir / "memory.events", "oom_kill")
        except (OSError, ValueError):
            return 0

    def limit_counters(self) -> dict[str, int]:
        out = {"pids_limit": 0, "cpu_throttled": 0, "oom_kill": self.oom_kills()}
        with contextlib.suppress(OSError, ValueError):
            out["pids_limit"] = fs.key(self.dir / "pids.events", "max")
        with contextlib.suppress(OSError, ValueError):
            out["cpu_throttled"] = fs.key(self.dir / "cpu.stat", "nr_throttled")
        return out

    def kill_all(self) -> None:
        with contextlib.suppress(OSError):
            fs.write(self.dir / "cgroup.kill", "1")
        with contextlib.suppress(OSError):
            fs.write(self.dir / "cgroup.freeze", "0")

    def _thaw_after_kill(self) -> None:
        with contextlib.suppress(OSError):
            fs.write(self.dir / "cgroup.freeze", "0")


class V2Hierarchy(Hierarchy):
    """Our place in the unified hierarchy: ``parents["v2"]``."""

    version = "v2"
    tree_kill = "cgroup.kill"

    def __init__(self, parent: Path, *, root: Path = CGROUP_ROOT, subdir: str = "edged",
                 swap_share: float = 1.0) -> None:
        super().__init__(root, subdir, swap_share)
        self.parents = {"v2": parent}
        self.swap_accounting = True

    @classmethod
    def probe(cls, root: Path, subdir: str, own: dict[str, str],
              swap_share: float = 1.0) -> V2Hierarchy | None:
        """The unified hierarchy at ``root``, if this process is in it alone and its cgroup
        offers cpu, memory and pids; None otherwise."""
        if not (root / "cgroup.controllers").exists() or set(own) != {""}:
            return None
        base = root / own[""].lstrip("/")
        if base.name == DAEMON_LEAF and "memory" in _controls(base.parent):
            # our own leaf, made by an earlier daemon in this process (or one that moved
            # this process with it): its sandboxes are beside it, under the same base. Taken
            # for a base of its own, each daemon started in the process nested one level
            # deeper (the node VM's test run reached 45 levels) and a restarted daemon
            # looked for its predecessor's sandboxes in the wrong place (none adopted)
            base = base.parent
        if not {"memory", "pids", "cpu"} <= set(fs.read(base / "cgroup.controllers").split()):
            return None
        return cls(base / subdir, root=root, subdir=subdir, swap_share=swap_share)

    def path_of(self, sandbox_id: str) -> SandboxCgroup:
        d = self.parents["v2"] / sandbox_id
        return V2Cgroup({"v2": d}, d)

    def _ensure_parents(self) -> None:
        p = self.parents["v2"]
        if p.exists():
            return
        base = p.parent
        # "no internal processes": the daemon moves into a leaf of its own (delegated)
        # cgroup before controllers are enabled for sandboxes.
        leaf = base / DAEMON_LEAF
        leaf.mkdir(exist_ok=True)
        for pid in fs.read(base / "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError, OSError):
                fs.write(leaf / "cgroup.procs", pid)
        fs.write(base / "cgroup.subtree_control", "+cpu +memory +pids")
        p.mkdir(exist_ok=True)
        fs.write(p / "cgroup.subtree_control", "+cpu +memory +pids")

    def bpf_dir(self) -> Path | None:
        self._ensure_parents()
        return self.parents["v2"]

    def _memory_parent(self) -> Path | None:
        return self.parents["v2"]

    def _cpu_parent(self) -> Path | None:
        return self.parents["v2"]

    def _memory_limit_file(self) -> tuple[Path, str] | None:
        return self.parents["v2"] / "memory.max", "max"

    def totals(self) -> MemoryUsage:
        return V2Cgroup({"v2": self.parents["v2"]}).memory_usage()

    def create(self, sandbox_id: str, res: Resources, root_uid: int, *,
               qos: str = "best_effort", bpf: bool = False) -> SandboxCgroup:
        """(``bpf``: the sandbox's own directory is its v2 cgroup: nothing more to make.)"""
        cg = self.path_of(sandbox_id)
        d = cg.dirs["v2"]
        try:
            self._ensure_parents()
            d.mkdir()
            fs.write(d / "cpu.max",
                     f"{max(1000, int(res.cpus * CFS_PERIOD_US))} {CFS_PERIOD_US}")
            fs.write(d / "cpu.weight", str(min(10000, max(1, int(res.cpus * 100)))))
            fs.write(d / "memory.max", str(res.memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                fs.write(d / "memory.swap.max", str(swap_allowance(res, self.swap_share)))
            fs.write(d / "pids.max", str(res.pids))
            # sbx-init's cgroup and, beneath, one per exec, without controllers (none is
            # enabled in subtree_control): one memory cgroup per sandbox (see base.py)
            (d / "init").mkdir()
            # systemd-style delegation: the dir and the files that move processes
            for p in (d, d / "cgroup.procs", d / "cgroup.subtree_control",
                      d / "cgroup.threads", d / "init", d / "init" / "cgroup.procs"):
                os.chown(p, root_uid, root_uid)
            cg.set_qos(qos)
        except OSError as exc:
            with contextlib.suppress(BackendError):
                cg.remove()
            raise BackendError(f"cgroup for sandbox {sandbox_id}: {exc}") from exc
        # The spawner joins the sandbox's directory itself, and its child's cgroup namespace
        # is rooted there: under nsdelegate (systemd mounts cgroup2 so) a task may move
        # tasks only between cgroups inside its namespace, and sbx-init makes its per-exec
        # cgroups beneath this directory (with the root at init/ every exec's move, and
        # clone3 into its cgroup, failed with ENOENT on a systemd node). It may hold tasks:
        # its cgroup.subtree_control enables nothing.
        cg.join = [d]
        return cg
