"""Per-sandbox cgroups for the container backend: probe, create with limits, freeze, stats,
remove. cgroup v2 (production) and v1/hybrid (this dev machine) behind one class.

Rules (from the host notes): never remount cgroups; create only beneath the cgroup that
``/proc/self/cgroup`` names for each controller; never write to a cgroup we did not create.
Our tree: ``<own cgroup>/edged/<sandbox id>`` in each hierarchy (v1 and v2; on v2 the
daemon's own process must then sit in a leaf, ``<own cgroup>/daemon``). The sandbox directory
is delegated to the sandbox's root uid (chown) so that sbx-init can make one cgroup per exec
beneath it (tree kill, peak memory, OOM).

Sources: Documentation/admin-guide/cgroup-v1/{memory,freezer-subsystem,pids}.rst and
cgroup-v2.rst of the Linux tree (file names and formats).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from edged.backends.base import MemoryUsage, Resources
from edged.errors import BackendError

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")
CFS_PERIOD_US = 100_000
#: Name prefix of cgroups made ahead for pooled spawners; no sandbox id starts with a dot.
POOL_PREFIX = ".pool-"


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read().decode()


def _flat_keyed(text: str) -> dict[str, int]:
    """A flat-keyed cgroup file (``memory.stat``, ``cpu.stat``): ``key value`` lines."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[k] = int(v)
    return out


def swap_allowance(res: Resources, share: float) -> int:
    """cgroup v2 ``memory.swap.max`` of a sandbox: what it asked for (``swap_bytes``), and at
    least ``share`` × its memory limit so that reclaim can page its cold memory out (with 0,
    v2 swaps none of it). v1 needs none of this: its ``memory.memsw.limit_in_bytes`` caps
    memory and swap together, and paging out moves a charge from one to the other."""
    return max(res.swap_bytes, int(res.memory_bytes * share))


def _self_cgroups() -> dict[str, str]:
    """controller name -> path from /proc/self/cgroup ("" key for the v2 line)."""
    out: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _hid, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c.removeprefix("name=")] = path
    return out


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox. ``join``: dirs the spawner enters;
    ``freezer``/``memory`` (v1) or ``v2``: the dirs delegated to sbx-init."""

    version: str
    dirs: dict[str, Path] = field(default_factory=dict)  # controller ("v2" for v2) -> dir
    join: list[Path] = field(default_factory=list)

    def _freezer(self) -> Path | None:
        return self.dirs.get("freezer") if self.version == "v1" else self.dirs.get("v2")

    def freeze(self, frozen: bool, timeout_s: float = 5.0) -> None:
        """Freeze (``frozen``) or thaw every task of the sandbox; waits until the kernel
        reports the state. Raises BackendError if it does not within ``timeout_s``."""
        d = self._freezer()
        if d is None:
            raise BackendError("no freezer cgroup for this sandbox")
        deadline = time.monotonic() + timeout_s
        if self.version == "v1":
            want = "FROZEN" if frozen else "THAWED"
            _write(d / "freezer.state", want)
            while _read(d / "freezer.state").strip() != want:
                if time.monotonic() > deadline:
                    raise BackendError(f"cgroup {d}: freezer did not reach {want}")
                _write(d / "freezer.state", want)
                time.sleep(0.001)
            return
        _write(d / "cgroup.freeze", "1" if frozen else "0")
        want_line = f"frozen {1 if frozen else 0}"
        while want_line not in _read(d / "cgroup.events"):
            if time.monotonic() > deadline:
                raise BackendError(f"cgroup {d}: did not reach {want_line}")
            time.sleep(0.001)

    def stats(self) -> dict[str, int]:
        """``memory_bytes`` (current usage), ``cpu_usage_ns``, ``pids`` (tasks now)."""
        out = {"memory_bytes": 0, "cpu_usage_ns": 0, "pids": 0}
        with contextlib.suppress(OSError, ValueError):
            if self.version == "v1":
                out["memory_bytes"] = int(_read(self.dirs["memory"] / "memory.usage_in_bytes"))
                out["cpu_usage_ns"] = int(_read(self.dirs["cpuacct"] / "cpuacct.usage"))
                out["pids"] = int(_read(self.dirs["pids"] / "pids.current"))
            elif self.version == "v2":
                d = self.dirs["v2"]
                out["memory_bytes"] = int(_read(d / "memory.current"))
                for line in _read(d / "cpu.stat").splitlines():
                    if line.startswith("usage_usec "):
                        out["cpu_usage_ns"] = int(line.split()[1]) * 1000
                out["pids"] = int(_read(d / "pids.current"))
        return out

    def memory_usage(self) -> MemoryUsage:
        """The sandbox's memory as its memory cgroup counts it (hierarchical: exec cgroups
        beneath included). v1: ``memory.usage_in_bytes`` and ``memory.stat``'s ``total_*``;
        v2: ``memory.current``, ``memory.stat``, ``memory.swap.current``. Zeros for what
        cannot be read (a sandbox being torn down)."""
        try:
            if self.version == "v1":
                m = self.dirs["memory"]
                st = _flat_keyed(_read(m / "memory.stat"))
                cpu = int(_read(self.dirs["cpuacct"] / "cpuacct.usage"))
                shmem = st.get("total_shmem", 0)
                return MemoryUsage(
                    resident_bytes=int(_read(m / "memory.usage_in_bytes")),
                    anon_bytes=st.get("total_rss", 0),
                    file_bytes=max(0, st.get("total_cache", 0) - shmem),
                    shmem_bytes=shmem,
                    swap_bytes=st.get("total_swap", 0),
                    major_faults=st.get("total_pgmajfault", 0),
                    cpu_usage_ns=cpu)
            if self.version == "v2":
                d = self.dirs["v2"]
                st = _flat_keyed(_read(d / "memory.stat"))
                swap = 0
                with contextlib.suppress(OSError, ValueError):
                    swap = int(_read(d / "memory.swap.current"))
                shmem = st.get("shmem", 0)
                return MemoryUsage(
                    resident_bytes=int(_read(d / "memory.current")),
                    anon_bytes=st.get("anon", 0),
                    file_bytes=max(0, st.get("file", 0) - shmem),
                    shmem_bytes=shmem,
                    swap_bytes=swap,
                    major_faults=st.get("pgmajfault", 0),
                    cpu_usage_ns=_flat_keyed(_read(d / "cpu.stat")).get("usage_usec", 0) * 1000)
        except (OSError, ValueError, KeyError):
            pass
        return MemoryUsage()

    def reclaim_v2(self, nbytes: int) -> None:
        """cgroup v2 proactive reclaim: write ``nbytes`` to ``memory.reclaim`` (the kernel
        reclaims that much from the cgroup, anon to swap as ``memory.swap.max`` allows).
        EAGAIN (less was reclaimable) is not an error. Raises BackendError otherwise."""
        d = self.dirs.get("v2")
        if d is None or nbytes <= 0:
            return
        try:
            _write(d / "memory.reclaim", str(nbytes))
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise BackendError(f"cgroup {d}: memory.reclaim: {exc.strerror}") from exc

    def procs(self) -> list[int]:
        """Host pids of every process in the sandbox's cgroups (all levels)."""
        return sorted(self._live_tasks())

    def set_qos(self, qos: str) -> None:
        """``best_effort``: the sandbox's CPU cgroup runs as SCHED_IDLE (``cpu.idle`` 1,
        Linux >= 5.15, v1 and v2): it gets only CPU time no normal task wants, and any normal
        task preempts it at wake-up; ``latency_sensitive``: normal (``cpu.idle`` 0). Silently
        nothing where the kernel has no ``cpu.idle``."""
        d = self.dirs.get("cpu") if self.version == "v1" else self.dirs.get("v2")
        if d is None:
            return
        with contextlib.suppress(FileNotFoundError):
            _write(d / "cpu.idle", "1" if qos == "best_effort" else "0")

    def oom_kills(self) -> int:
        """OOM kills counted in the sandbox's memory cgroup (v1 memory.oom_control, v2
        memory.events ``oom_kill``)."""
        try:
            if self.version == "v1":
                text = _read(self.dirs["memory"] / "memory.oom_control")
            else:
                text = _read(self.dirs["v2"] / "memory.events")
        except (OSError, KeyError):
            return 0
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def kill_all(self) -> None:
        """SIGKILL every task in the sandbox's cgroups (all levels). Thaws every level
        before and after: on v1 a frozen task does not die until thawed, and sbx-init freezes
        an exec's own cgroup to kill its tree, so one killed mid-way leaves that cgroup
        frozen (self-frozen: thawing the parent does not thaw it)."""
        if self.version == "v2":
            d = self.dirs["v2"]
            with contextlib.suppress(OSError):
                _write(d / "cgroup.kill", "1")
            with contextlib.suppress(OSError):
                _write(d / "cgroup.freeze", "0")
            return
        frz = self.dirs.get("freezer")
        self._thaw_all(frz)
        for d in self.dirs.values():
            for sub, _dirs, _files in os.walk(d):
                with contextlib.suppress(OSError):
                    for pid in _read(Path(sub) / "cgroup.procs").split():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), 9)
        self._thaw_all(frz)

    def kill_workload(self, keep_pid: int, timeout_s: float = 10.0) -> int:
        """SIGKILL every task of the sandbox but ``keep_pid`` (sbx-init, host pid), with
        the whole sandbox frozen while its tasks are listed and signalled, so that a fork
        bomb cannot add tasks between the listing and the kill; repeated until no task
        but ``keep_pid`` is left. Returns the number of processes killed. Raises
        BackendError if tasks are still left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        frz = self._freezer()
        killed = 0
        while True:
            if frz is not None:
                self.freeze(True, timeout_s=max(0.1, deadline - time.monotonic()))
            try:
                left = self._live_tasks() - {keep_pid}
                for pid in left:
                    with contextlib.suppress(OSError):
                        os.kill(pid, 9)
                        killed += 1
            finally:
                if self.version == "v1":
                    self._thaw_all(frz)
                elif frz is not None:
                    with contextlib.suppress(OSError):
                        _write(frz / "cgroup.freeze", "0")
            if not left:
                return killed
            if time.monotonic() > deadline:
                raise BackendError(f"{len(left)} processes still alive after {timeout_s} s "
                                   f"of killing")
            time.sleep(0.002)  # let the killed tasks exit before listing again

    def _live_tasks(self) -> set[int]:
        """Thread-group ids in every cgroup level of the sandbox, zombies left out (they
        wait for sbx-init to reap them)."""
        pids: set[int] = set()
        for d in set(self.dirs.values()):
            for sub, _dirs, _files in os.walk(d):
                with contextlib.suppress(OSError):
                    pids.update(int(x) for x in _read(Path(sub) / "cgroup.procs").split())
        live = set()
        for pid in pids:
            try:
                stat = _read(Path(f"/proc/{pid}/stat"))
            except OSError:
                continue
            if stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X"):
                live.add(pid)
        return live

    @staticmethod
    def _thaw_all(frz: Path | None) -> None:
        if frz is None:
            return
        for sub, _dirs, _files in os.walk(frz):
            with contextlib.suppress(OSError):
                _write(Path(sub) / "freezer.state", "THAWED")

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove every directory (deepest first). Idempotent.
        Raises BackendError if a cgroup stays busy for ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen: set[Path] = set()
        for d in self.dirs.values():
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
                    time.sleep(0.002)


class CgroupManager:
    """Finds our place in the cgroup tree at start-up and makes sandbox cgroups there.

    ``version``: ``"v2"``, ``"v1"`` or ``"none"`` (no usable controllers: sandboxes run
    without limits and sbx-init falls back to a session sweep for tree kills).
    """

    def __init__(self, root: Path = CGROUP_ROOT, subdir: str = "edged",
                 swap_share: float = 1.0) -> None:
        self.root = root
        self.subdir = subdir
        self.swap_share = swap_share
        self.version = "none"
        self.parents: dict[str, Path] = {}
        self.swap_accounting = False
        self._probe()

    def _probe(self) -> None:
        own = _self_cgroups()
        if (self.root / "cgroup.controllers").exists() and set(own) == {""}:
            base = self.root / own[""].lstrip("/")
            ctrls = set(_read(base / "cgroup.controllers").split())
            if {"memory", "pids", "cpu"} <= ctrls:
                self.version = "v2"
                self.parents = {"v2": base / self.subdir}
                self.swap_accounting = True
            return
        parents: dict[str, Path] = {}
        for c in V1_CONTROLLERS:
            mount = self.root / c
            if c not in own or not (mount / "cgroup.procs").exists():
                return
            parents[c] = mount.resolve() / own[c].lstrip("/") / self.subdir
        self.version = "v1"
        self.parents = parents
        self.swap_accounting = (parents["memory"].parent / "memory.memsw.limit_in_bytes").exists()

    def features(self) -> dict[str, object]:
        base = {"v1": self.parents.get("memory"), "v2": self.parents.get("v2")}.get(
            self.version)
        cpu = {"v1": self.parents.get("cpu"), "v2": self.parents.get("v2")}.get(self.version)
        return {
            "cgroup": self.version,
            "cgroup_parents": {k: str(v) for k, v in self.parents.items()},
            "swap_accounting": self.swap_accounting,
            # v2's proactive reclaim (Linux >= 5.19); v1 pages out through process_madvise
            "memory_reclaim": bool(base and (base.parent / "memory.reclaim").exists()),
            "cpu_idle": bool(cpu and (cpu.parent / "cpu.idle").exists()),
        }

    def set_memory_limit(self, nbytes: int) -> None:
        """Cap the memory of all sandboxes together (our parent memory cgroup; v1
        ``memory.limit_in_bytes``, v2 ``memory.max``): the backstop that keeps the host's
        share free whatever the sandboxes do, reclaim (to swap) and then OOM kills staying
        among them. 0: no cap. Raises BackendError."""
        if self.version == "none":
            return
        try:
            self._ensure_parents()
            if self.version == "v1":
                _write(self.parents["memory"] / "memory.limit_in_bytes",
                       str(nbytes) if nbytes else "-1")
            else:
                _write(self.parents["v2"] / "memory.max", str(nbytes) if nbytes else "max")
        except OSError as exc:
            raise BackendError(f"cgroup memory limit of all sandboxes: {exc}") from exc

    def totals(self) -> MemoryUsage:
        """Every sandbox's memory together (our parent cgroup, hierarchical)."""
        cg = SandboxCgroup(self.version)
        if self.version == "v1":
            cg.dirs = {"memory": self.parents["memory"], "cpuacct": self.parents["cpuacct"]}
        elif self.version == "v2":
            cg.dirs = {"v2": self.parents["v2"]}
        return cg.memory_usage()

    def _ensure_parents(self) -> None:
        if self.version == "v2":
            p = self.parents["v2"]
            if p.exists():
                return
            base = p.parent
            # v2 "no internal processes": the daemon moves into a leaf of its own
            # (delegated) cgroup before controllers are enabled for sandboxes.
            leaf = base / "daemon"
            leaf.mkdir(exist_ok=True)
            for pid in _read(base / "cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError, OSError):
                    _write(leaf / "cgroup.procs", pid)
            _write(base / "cgroup.subtree_control", "+cpu +memory +pids")
            p.mkdir(exist_ok=True)
            _write(p / "cgroup.subtree_control", "+cpu +memory +pids")
            return
        for p in self.parents.values():
            p.mkdir(exist_ok=True)

    def prune(self) -> None:
        """Remove our parent cgroups if they hold no sandbox (rmdir refuses a busy one)."""
        for p in self.parents.values():
            with contextlib.suppress(OSError):
                p.rmdir()

    def path_of(self, sandbox_id: str) -> SandboxCgroup:
        """The (possibly not existing) cgroup of a sandbox."""
        cg = SandboxCgroup(self.version)
        for c, p in self.parents.items():
            cg.dirs[c] = p / sandbox_id
        return cg

    def existing(self) -> set[str]:
        """Sandbox ids that have a cgroup directory in any of our hierarchies."""
        out: set[str] = set()
        for p in self.parents.values():
            with contextlib.suppress(FileNotFoundError):
                out.update(e.name for e in os.scandir(p) if e.is_dir())
        return out

    def create(self, sandbox_id: str, res: Resources, root_uid: int,
               qos: str = "best_effort") -> SandboxCgroup:
        """Make the sandbox's cgroups with limits from ``res`` and CPU class ``qos`` and
        delegate them to host uid ``root_uid`` (sandbox root). Raises BackendError (the
        half-made cgroups removed)."""
        cg = self.path_of(sandbox_id)
        if self.version == "none":
            return cg
        try:
            self._ensure_parents()
            if self.version == "v1":
                self._create_v1(cg, res, root_uid)
            else:
                self._create_v2(cg, res, root_uid)
            cg.set_qos(qos)
        except OSError as exc:
            with contextlib.suppress(BackendError):
                cg.remove()
            raise BackendError(f"cgroup for sandbox {sandbox_id}: {exc}") from exc
        return cg

    def create_pooled(self, tag: str, root_uid: int) -> SandboxCgroup | None:
        """Cgroups ``.pool-<tag>`` for a pooled spawner, made ahead of demand and delegated to
        host uid ``root_uid``, without limits yet: the spawner moves itself and its child in
        at once (a move waits for an RCU grace period when none happened lately, milliseconds,
        kept off the create), and :meth:`claim` renames them to a sandbox's. v1 only (v2
        cannot rename cgroups; there CLONE_INTO_CGROUP is the way to skip the move): None
        elsewhere. Raises BackendError (nothing left)."""
        if self.version != "v1":
            return None
        cg = self.path_of(POOL_PREFIX + tag)
        try:
            self._ensure_parents()
            for d in dict.fromkeys(cg.dirs.values()):
                d.mkdir()
            for c in ("freezer", "memory"):
                os.chown(cg.dirs[c], root_uid, root_uid)
        except OSError as exc:
            with contextlib.suppress(BackendError):
                cg.remove()
            raise BackendError(f"pooled cgroup {tag}: {exc}") from exc
        cg.join = list(dict.fromkeys(cg.dirs.values()))
        return cg

    def claim(self, pooled: SandboxCgroup, sandbox_id: str, res: Resources,
              qos: str = "best_effort") -> SandboxCgroup:
        """Rename pooled cgroups (:meth:`create_pooled`) to ``sandbox_id``'s, their tasks
        staying in them, and set the limits from ``res`` and the CPU class ``qos``. Raises
        BackendError (what was renamed is renamed back)."""
        cg = self.path_of(sandbox_id)
        done: list[tuple[Path, Path]] = []
        try:
            for src, dst in {pooled.dirs[c]: cg.dirs[c] for c in pooled.dirs}.items():
                os.rename(src, dst)
                done.append((src, dst))
            self._limits_v1(cg, res)
            cg.set_qos(qos)
        except OSError as exc:
            for src, dst in reversed(done):
                with contextlib.suppress(OSError):
                    os.rename(dst, src)
            raise BackendError(f"cgroup for sandbox {sandbox_id}: {exc}") from exc
        cg.join = list(dict.fromkeys(cg.dirs.values()))
        return cg

    def _create_v1(self, cg: SandboxCgroup, res: Resources, root_uid: int) -> None:
        for d in cg.dirs.values():
            d.mkdir()
        self._limits_v1(cg, res)
        for c in ("freezer", "memory"):
            os.chown(cg.dirs[c], root_uid, root_uid)
        cg.join = list(dict.fromkeys(cg.dirs.values()))

    def _limits_v1(self, cg: SandboxCgroup, res: Resources) -> None:
        cpu, mem = cg.dirs["cpu"], cg.dirs["memory"]
        _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(res.cpus * CFS_PERIOD_US))))
        _write(cpu / "cpu.shares", str(max(2, int(res.cpus * 1024))))
        _write(mem / "memory.limit_in_bytes", str(res.memory_bytes))
        if self.swap_accounting:
            # memory + swap together: reclaim pages an idle sandbox out within it (the
            # charge moves from memory to swap), so no swap beyond what it asked for
            _write(mem / "memory.memsw.limit_in_bytes", str(res.memory_bytes + res.swap_bytes))
        _write(cg.dirs["pids"] / "pids.max", str(res.pids))

    def _create_v2(self, cg: SandboxCgroup, res: Resources, root_uid: int) -> None:
        d = cg.dirs["v2"]
        d.mkdir()
        _write(d / "cpu.max", f"{max(1000, int(res.cpus * CFS_PERIOD_US))} {CFS_PERIOD_US}")
        _write(d / "cpu.weight", str(min(10000, max(1, int(res.cpus * 100)))))
        _write(d / "memory.max", str(res.memory_bytes))
        with contextlib.suppress(FileNotFoundError):
            _write(d / "memory.swap.max", str(swap_allowance(res, self.swap_share)))
        _write(d / "pids.max", str(res.pids))
        (d / "init").mkdir()
        _write(d / "cgroup.subtree_control", "+memory +pids")
        # systemd-style delegation: the dir and the files that move processes
        for p in (d, d / "cgroup.procs", d / "cgroup.subtree_control", d / "cgroup.threads",
                  d / "init", d / "init" / "cgroup.procs"):
            os.chown(p, root_uid, root_uid)
        cg.join = [d / "init"]
