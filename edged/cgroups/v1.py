"""cgroup v1 (and hybrid) sandbox cgroups: one directory per controller (cpu, cpuacct,
memory, pids, freezer), each in its own hierarchy. On a hybrid host (v1 controllers, and the
v2 hierarchy mounted without controllers, e.g. at ``/sys/fs/cgroup/unified``) a sandbox may
also get a directory in the v2 hierarchy: cgroup BPF programs attach to v2 cgroups only.

CPU classes: a best-effort sandbox's cpu cgroup is beneath ``<own>/<subdir>-idle``, a sibling
of our ``<own>/<subdir>`` marked ``cpu.idle`` (SCHED_IDLE for the whole group), so that at the
level where the daemon, its clients and the latency-sensitive sandboxes compete, all
best-effort work is one idle entity that any of them preempts at wake-up. (``cpu.idle`` on each
best-effort sandbox alone makes it idle only among the sandboxes: our parent group, busy with
it, still competes at normal weight with the daemon serving the latency-sensitive ones.)

Sources: Documentation/admin-guide/cgroup-v1/{cgroups,memory,freezer-subsystem,pids}.rst,
scheduler/sched-bwc.rst (cfs quota and period).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from edged.cgroups import fs
from edged.cgroups.base import CFS_PERIOD_US, CGROUP_ROOT, POOL_PREFIX, Hierarchy, SandboxCgroup
from edged.datatypes import MemoryUsage, Resources
from edged.errors import BackendError

CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")


class V1Cgroup(SandboxCgroup):
    """A sandbox's directories in the v1 hierarchies (``dirs`` by controller)."""

    version = "v1"

    def sbx_init_dirs(self) -> dict[str, Path]:
        return {"freezer": self.dirs["freezer"], "memory": self.dirs["memory"]}

    def memory_join(self) -> Path | None:
        # ``tasks``: a single-threaded process moving itself skips the global
        # cgroup_threadgroup_rwsem (see the container backend's notes on cgroup moves)
        return self.dirs["memory"] / "tasks"

    def freeze(self, frozen: bool, timeout_s: float = 5.0) -> None:
        d = self.dirs["freezer"]
        deadline = time.monotonic() + timeout_s
        want = "FROZEN" if frozen else "THAWED"
        fs.write(d / "freezer.state", want)
        while fs.read(d / "freezer.state").strip() != want:
            if time.monotonic() > deadline:
                raise BackendError(f"cgroup {d}: freezer did not reach {want}")
            fs.write(d / "freezer.state", want)
            time.sleep(0.001)

    def frozen(self) -> bool:
        try:
            return fs.read(self.dirs["freezer"] / "freezer.state").strip() != "THAWED"
        except OSError:
            return False

    def stats(self) -> dict[str, int]:
        out = {"memory_bytes": 0, "cpu_usage_ns": 0, "pids": 0}
        with contextlib.suppress(OSError, ValueError):
            out["memory_bytes"] = int(fs.read(self.dirs["memory"] / "memory.usage_in_bytes"))
            out["cpu_usage_ns"] = int(fs.read(self.dirs["cpuacct"] / "cpuacct.usage"))
            out["pids"] = int(fs.read(self.dirs["pids"] / "pids.current"))
        return out

    def memory_usage(self) -> MemoryUsage:
        """``memory.usage_in_bytes`` and ``memory.stat``'s hierarchical ``total_*``; the CPU
        wait is its threads' run-queue delay (v1 has no per-cgroup PSI; every thread of the
        sandbox is in its cpuacct cgroup itself, exec cgroups being freezer-only)."""
        try:
            m = self.dirs["memory"]
            st = fs.flat_keyed(m / "memory.stat")
            shmem = st.get("total_shmem", 0)
            return MemoryUsage(
                resident_bytes=int(fs.read(m / "memory.usage_in_bytes")),
                anon_bytes=st.get("total_rss", 0),
                file_bytes=max(0, st.get("total_cache", 0) - shmem),
                shmem_bytes=shmem,
                swap_bytes=st.get("total_swap", 0),
                major_faults=st.get("total_pgmajfault", 0),
                cpu_usage_ns=int(fs.read(self.dirs["cpuacct"] / "cpuacct.usage")),
                cpu_wait_ns=fs.run_delay_ns(self.dirs["cpuacct"] / "tasks"))
        except (OSError, ValueError, KeyError):
            return MemoryUsage()

    def reclaim(self, nbytes: int) -> bool:
        """v1 has no ``memory.reclaim``; ``memory.force_empty`` is its whole-cgroup form: the
        kernel reclaims the cgroup's pages until none is left or 16 passes free nothing
        (mm/memcontrol-v1.c, mem_cgroup_force_empty: try_to_free_mem_cgroup_pages with
        MEMCG_RECLAIM_MAY_SWAP; tasks may stay in the cgroup, a frozen one too): anonymous
        and tmpfs pages (the upper) to swap, page cache dropped, and, through the memcg-aware
        shrinkers, the dentries and inodes charged to it. Unlike ``process_madvise`` it
        reaches pages shared copy-on-write between processes (sbx-init and its spare), which
        MADV_PAGEOUT skips, and the tmpfs pages no process maps. ``nbytes`` is no bound here:
        everything goes. False without the file (the caller pages out per process).
        Raises BackendError."""
        f = self.dirs["memory"] / "memory.force_empty"
        if not f.exists():
            return False
        if nbytes <= 0:
            return True
        try:
            fs.write(f, "0")
        except OSError as exc:
            raise BackendError(f"cgroup {f.parent}: memory.force_empty: {exc.strerror}") from exc
        return True

    def set_qos(self, qos: str) -> None:
        """Best-effort sandboxes are idle by their parent (see the module), each one
        normal among them; where that parent is not idle (an older tree), by their own."""
        d = self.dirs["cpu"]
        idle_parent = d.parent.name.endswith("-idle")
        with contextlib.suppress(FileNotFoundError):
            fs.write(d / "cpu.idle", "1" if qos == "best_effort" and not idle_parent else "0")

    def unthrottle(self, leave_idle: bool = False) -> None:
        """No quota, ``cpu.idle`` 0 and, with ``leave_idle``, beneath the idle parent (which
        no setting of the sandbox's own lifts), its processes moved up to the normal
        parent."""
        d = self.dirs["cpu"]
        with contextlib.suppress(OSError):
            fs.write(d / "cpu.cfs_quota_us", "-1")
        with contextlib.suppress(OSError):
            fs.write(d / "cpu.idle", "0")
        if not (leave_idle and d.parent.name.endswith("-idle")):
            return
        normal = d.parent.with_name(d.parent.name.removesuffix("-idle"))
        with contextlib.suppress(OSError):
            for pid in fs.procs(d):
                with contextlib.suppress(OSError):  # gone already, or a zombie
                    fs.write(normal / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        try:
            return fs.key(self.dirs["memory"] / "memory.oom_control", "oom_kill")
        except (OSError, ValueError):
            return 0

    def limit_counters(self) -> dict[str, int]:
        out = {"pids_limit": 0, "cpu_throttled": 0, "oom_kill": self.oom_kills()}
        with contextlib.suppress(OSError, ValueError):
            out["pids_limit"] = fs.key(self.dirs["pids"] / "pids.events", "max")
        with contextlib.suppress(OSError, ValueError):
            out["cpu_throttled"] = fs.key(self.dirs["cpu"] / "cpu.stat", "nr_throttled")
        return out

    def kill_all(self) -> None:
        """Thaws every level before and after: a frozen task does not die until thawed, and
        sbx-init freezes an exec's own cgroup to kill its tree, so one killed mid-way leaves
        that cgroup frozen (self-frozen: thawing the parent does not thaw it)."""
        self._thaw_after_kill()
        for d in self.dirs.values():
            fs.kill_procs(d)
        self._thaw_after_kill()

    def _thaw_after_kill(self) -> None:
        for sub, _dirs, _files in os.walk(self.dirs["freezer"]):
            with contextlib.suppress(OSError):
                fs.write(Path(sub) / "freezer.state", "THAWED")


class V1Hierarchy(Hierarchy):
    """Our place in each v1 hierarchy; ``unified``: our directory in the controller-less v2
    hierarchy of a hybrid host (None if it has none), for the sandboxes' BPF directories;
    ``idle_cpu``: the parent of best-effort sandboxes' cpu cgroups (see the module)."""

    version = "v1"
    tree_kill = "freezer"

    def __init__(self, parents: dict[str, Path], unified: Path | None = None, *,
                 root: Path = CGROUP_ROOT, subdir: str = "edged",
                 swap_share: float = 1.0) -> None:
        super().__init__(root, subdir, swap_share)
        self.parents = parents
        self.unified = unified
        self.idle_cpu = parents["cpu"].parent / f"{parents['cpu'].name}-idle"
        self.swap_accounting = (parents["memory"].parent / "memory.memsw.limit_in_bytes"
                                ).exists()

    @classmethod
    def probe(cls, root: Path, subdir: str, own: dict[str, str],
              swap_share: float = 1.0) -> V1Hierarchy | None:
        """The v1 hierarchies of ``own`` (this process's cgroups), if every controller we
        need is mounted under ``root``; None otherwise."""
        parents: dict[str, Path] = {}
        for c in CONTROLLERS:
            mount = root / c
            if c not in own or not (mount / "cgroup.procs").exists():
                return None
            parents[c] = mount.resolve() / own[c].lstrip("/") / subdir
        unified = None
        mnt = fs.v2_mount()
        if mnt is not None and "" in own:
            unified = mnt / own[""].lstrip("/") / subdir
        return cls(parents, unified, root=root, subdir=subdir, swap_share=swap_share)

    def features(self) -> dict[str, object]:
        feats = super().features()
        feats["cgroup_bpf_parent"] = str(self.unified) if self.unified else None
        return feats

    def _memory_parent(self) -> Path | None:
        return self.parents["memory"]

    def _cpu_parent(self) -> Path | None:
        return self.parents["cpu"]

    def _memory_limit_file(self) -> tuple[Path, str] | None:
        return self.parents["memory"] / "memory.limit_in_bytes", "-1"

    def totals(self) -> MemoryUsage:
        return V1Cgroup({"memory": self.parents["memory"],
                         "cpuacct": self.parents["cpuacct"]}).memory_usage()

    def path_of(self, sandbox_id: str, qos: str | None = None) -> SandboxCgroup:
        """The sandbox's directories; its cpu one by ``qos``, or where it exists (the
        normal parent if nowhere)."""
        dirs = {c: p / sandbox_id for c, p in self.parents.items()}
        if qos == "best_effort" or (qos is None and (self.idle_cpu / sandbox_id).is_dir()):
            dirs["cpu"] = self.idle_cpu / sandbox_id
        return V1Cgroup(dirs, self.unified / sandbox_id if self.unified else None)

    def _ensure_parents(self) -> None:
        for p in self.parents.values():
            p.mkdir(exist_ok=True)
        if not self.idle_cpu.is_dir():
            self.idle_cpu.mkdir(exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # no cpu.idle: a plain sibling
                fs.write(self.idle_cpu / "cpu.idle", "1")

    def _extra_parents(self) -> list[Path]:
        return [self.idle_cpu, *super()._extra_parents()]

    def _bpf_parent(self) -> Path | None:
        return self.unified

    def bpf_dir(self) -> Path | None:
        if self.unified is None:
            return None
        self.unified.mkdir(exist_ok=True)
        return self.unified

    def _make_bpf_dir(self, cg: SandboxCgroup, bpf: bool) -> None:
        """The sandbox's own v2 directory (to be joined), or none: ``bpf_dir`` None."""
        if not bpf or cg.bpf_dir is None:
            cg.bpf_dir = None
            return
        self.bpf_dir()
        cg.bpf_dir.mkdir()
        cg.join.append(cg.bpf_dir)

    def create(self, sandbox_id: str, res: Resources, root_uid: int, *,
               qos: str = "best_effort", bpf: bool = False) -> SandboxCgroup:
        cg = self.path_of(sandbox_id, qos)
        try:
            self._ensure_parents()
            for d in cg.dirs.values():
                d.mkdir()
            self._limits(cg, res)
            cg.set_qos(qos)
            # freezer only: sbx-init makes its exec cgroups there; the memory cgroup it only
            # reads (OOM kills), and one made per exec would cost the host (see base.py)
            os.chown(cg.dirs["freezer"], root_uid, root_uid)
            cg.join = list(dict.fromkeys(cg.dirs.values()))
            self._make_bpf_dir(cg, bpf)
        except OSError as exc:
            with contextlib.suppress(BackendError):
                cg.remove()
            raise BackendError(f"cgroup for sandbox {sandbox_id}: {exc}") from exc
        return cg

    def reclass(self, cg: SandboxCgroup, qos: str) -> None:
        """The cpu cgroup's class is its parent (see the module): a cpu cgroup of the same
        limits is made beneath the other parent, the tasks move there (a process at a time:
        cgroup.procs moves every thread of it), the old one goes. Raises BackendError (the
        tasks then stay where they were, or are already in the new cgroup)."""
        src = cg.dirs["cpu"]
        dst = self.path_of(src.name, qos).dirs["cpu"]
        if src == dst:
            return super().reclass(cg, qos)
        made = False
        try:
            dst.mkdir()
            made = True
            for f in ("cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares"):
                fs.write(dst / f, fs.read(src / f).strip())
            if not dst.parent.name.endswith("-idle"):
                with contextlib.suppress(FileNotFoundError):
                    fs.write(dst / "cpu.idle", "0")
            for _ in range(3):  # a task forked during the move lands in src: again
                pids = fs.procs(src)
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        fs.write(dst / "cgroup.procs", str(pid))
            src.rmdir()
        except OSError as exc:
            if made and not fs.procs(dst):
                with contextlib.suppress(OSError):
                    dst.rmdir()
            raise BackendError(f"cgroup {src}: to CPU class {qos}: {exc}") from exc
        cg.dirs["cpu"] = dst
        cg.join = [dst if d == src else d for d in cg.join]

    def create_pooled(self, tag: str, root_uid: int, *,
                      qos: str = "best_effort") -> SandboxCgroup | None:
        """In the cpu parent of class ``qos`` (a claim of the other class moves the tasks
        between the two: see :meth:`claim`)."""
        cg = self.path_of(POOL_PREFIX + tag, qos)
        cg.bpf_dir = None
        try:
            self._ensure_parents()
            for d in dict.fromkeys(cg.dirs.values()):
                d.mkdir()
            # freezer only: sbx-init makes its exec cgroups there; the memory cgroup it only
            # reads (OOM kills), and one made per exec would cost the host (see base.py)
            os.chown(cg.dirs["freezer"], root_uid, root_uid)
        except OSError as exc:
            with contextlib.suppress(BackendError):
                cg.remove()
            raise BackendError(f"pooled cgroup {tag}: {exc}") from exc
        cg.join = list(dict.fromkeys(cg.dirs.values()))
        return cg

    def claim(self, pooled: SandboxCgroup, sandbox_id: str, res: Resources, *,
              qos: str = "best_effort", bpf: bool = False) -> SandboxCgroup:
        cg = self.path_of(sandbox_id, qos)
        done: list[tuple[Path, Path]] = []
        made: Path | None = None
        try:
            for c, src in pooled.dirs.items():
                dst = cg.dirs[c]
                if src.parent == dst.parent:
                    os.rename(src, dst)
                    done.append((src, dst))
                    continue
                # v1 renames a cgroup within its parent only: a sandbox of the other CPU
                # class than the pooled cgroups' gets a cpu cgroup of its own and the
                # pooled tasks move there (a move waits for an RCU grace period: after an
                # idle spell, milliseconds)
                dst.mkdir()
                made = dst
                for pid in fs.procs(src):
                    with contextlib.suppress(ProcessLookupError):
                        fs.write(dst / "cgroup.procs", str(pid))
                src.rmdir()
            self._limits(cg, res)
            cg.set_qos(qos)
            self._make_bpf_dir(cg, bpf)  # the one directory the spawner still joins
        except OSError as exc:
            for src, dst in reversed(done):
                with contextlib.suppress(OSError):
                    os.rename(dst, src)
            if made is not None:
                with contextlib.suppress(OSError):
                    made.rmdir()
            raise BackendError(f"cgroup for sandbox {sandbox_id}: {exc}") from exc
        return cg

    def _limits(self, cg: SandboxCgroup, res: Resources) -> None:
        cpu, mem = cg.dirs["cpu"], cg.dirs["memory"]
        fs.write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        fs.write(cpu / "cpu.cfs_quota_us", str(max(1000, int(res.cpus * CFS_PERIOD_US))))
        fs.write(cpu / "cpu.shares", str(max(2, int(res.cpus * 1024))))
        fs.write(mem / "memory.limit_in_bytes", str(res.memory_bytes))
        if self.swap_accounting:
            # memory + swap together: reclaim pages an idle sandbox out within it (the
            # charge moves from memory to swap), so no swap beyond what it asked for
            fs.write(mem / "memory.memsw.limit_in_bytes",
                     str(res.memory_bytes + res.swap_bytes))
        fs.write(cg.dirs["pids"] / "pids.max", str(res.pids))
