"""The cgroups room: one interface over v1 and v2. On this host (whatever it has): probe,
create with limits, a task joined, stats and limit counters, freeze and thaw, kill the
workload but one task, remove; the per-sandbox v2 directory for cgroup BPF (hybrid hosts: in
the controller-less v2 hierarchy) and a pooled cgroup handed on with one. The v2 readers on
a fake tree, so that they are checked on a v1 host too."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.backends.base import Resources
from edged.cgroups import Hierarchy, SandboxCgroup, fs, probe
from edged.cgroups.none import NoCgroup
from edged.cgroups.v1 import V1Hierarchy
from edged.cgroups.v2 import V2Cgroup, V2Hierarchy
from edged.errors import BackendError

pytestmark = pytest.mark.root


@pytest.fixture
def hier(tmp_path: Path) -> Iterator[Hierarchy]:
    h = probe(subdir=f"edged-test-{os.getpid()}-{tmp_path.name}")
    if h.version == "none":
        pytest.skip("no usable cgroups on this host")
    yield h
    for sid in h.existing():
        h.path_of(sid).remove()
    h.prune()
    assert not any(p.exists() for p in h.parents.values())
    if isinstance(h, V1Hierarchy) and h.unified is not None:
        assert not h.unified.exists()


def _join(cg: SandboxCgroup) -> subprocess.Popen[bytes]:
    """A sleeping task moved into every directory of ``cg.join``."""
    proc = subprocess.Popen(["sleep", "100"])
    for d in cg.join:
        (d / "cgroup.procs").write_text(str(proc.pid))
    return proc


def test_probe_matches_this_process(hier: Hierarchy) -> None:
    own = fs.self_cgroups()
    assert hier.version == ("v2" if set(own) == {""} else "v1")
    assert hier.features()["cgroup"] == hier.version
    assert hier.tree_kill in ("freezer", "cgroup.kill")


def test_lifecycle_through_the_interface(hier: Hierarchy) -> None:
    cg = hier.create("s1", Resources(cpus=0.5, memory_bytes=64 << 20, pids=32), os.getuid())
    assert hier.existing() == {"s1"} and cg.join and cg.sbx_init_dirs()
    assert all(p.is_dir() for p in cg.sbx_init_dirs().values())
    proc = _join(cg)
    try:
        st = cg.stats()
        assert st["pids"] == 1  # (memory charged before the move stays where it was, v1)
        assert cg.limit_counters() == {"pids_limit": 0, "cpu_throttled": 0, "oom_kill": 0}
        assert not cg.frozen()
        cg.freeze(True)
        assert cg.frozen() and hier.path_of("s1").frozen()
        cg.freeze(False)
        assert not cg.frozen()
        assert cg.kill_workload(keep_pid=-1) == 1
        assert proc.wait(5) == -9
    finally:
        proc.kill()
        proc.wait()
    cg.remove()
    cg.remove()  # idempotent
    assert hier.existing() == set()


def test_kill_workload_counts_each_process_once() -> None:
    """A killed process that is slow to exit (a large address space to tear down; seen under
    load) is listed again on the next pass: it was counted once per pass."""
    proc = subprocess.Popen(["sleep", "100"])
    passes = [{proc.pid}, {proc.pid}, set()]  # still listed once after its SIGKILL

    class Slow(NoCgroup):
        kill_workload = SandboxCgroup.kill_workload  # the loop under test (NoCgroup refuses)

        def freeze(self, frozen: bool, timeout_s: float = 5.0) -> None:
            pass

        def _live_tasks(self) -> set[int]:
            return passes.pop(0)

    try:
        assert Slow({}).kill_workload(keep_pid=-1) == 1 and not passes
    finally:
        proc.kill()
        proc.wait()


def test_kill_workload_kills_a_sandbox_that_does_not_freeze_whole() -> None:
    """Bug (found with test_kill_processes_then_grader at load 40-100): a throttled fork
    bomb's sandbox had not reached FROZEN within kill_workload's 10 s, which raised
    BackendError without killing anything, and without thawing what had frozen. What is
    listed is killed all the same, and what was frozen is thawed."""
    proc = subprocess.Popen(["sleep", "100"])
    thawed: list[bool] = []

    class Stuck(NoCgroup):
        kill_workload = SandboxCgroup.kill_workload  # the loop under test (NoCgroup refuses)

        def freeze(self, frozen: bool, timeout_s: float = 5.0) -> None:
            time.sleep(min(timeout_s, 0.05))
            raise BackendError("cgroup stuck: freezer did not reach FROZEN")

        def _live_tasks(self) -> set[int]:
            return set() if proc.poll() is not None else {proc.pid}

        def _thaw_after_kill(self) -> None:
            thawed.append(True)

    try:
        assert Stuck({}).kill_workload(keep_pid=-1, timeout_s=5) == 1
        assert proc.wait(5) == -9 and thawed
    finally:
        proc.kill()
        proc.wait()


def test_remove_kills_what_is_left(hier: Hierarchy) -> None:
    cg = hier.create("s2", Resources(), os.getuid())
    proc = _join(cg)
    cg.remove()
    assert proc.wait(5) == -9 and hier.existing() == set()


def test_bpf_dir_per_sandbox(hier: Hierarchy) -> None:
    """With ``bpf``, a sandbox has a v2 directory of its own beneath :meth:`bpf_dir` (on a
    hybrid host one more to join), which its tasks are in and which goes with it."""
    parent = hier.bpf_dir()
    if parent is None:
        pytest.skip("no cgroup v2 hierarchy on this host")
    plain = hier.create("plain", Resources(), os.getuid())
    assert plain.bpf_dir is None or hier.version == "v2"
    cg = hier.create("net", Resources(), os.getuid(), bpf=True)
    assert cg.bpf_dir is not None and cg.bpf_dir.parent == parent and cg.bpf_dir.is_dir()
    proc = _join(cg)
    try:
        assert str(proc.pid) in (cg.bpf_dir / "cgroup.procs").read_text().split() or \
            proc.pid in fs.procs(cg.bpf_dir)
    finally:
        proc.kill()
        proc.wait()
    cg.remove()
    plain.remove()
    assert not cg.bpf_dir.exists() and hier.existing() == set()


def test_pooled_cgroup_claimed_with_a_bpf_dir(hier: Hierarchy) -> None:
    """A pooled spawner's cgroups are renamed to the sandbox's; only the BPF directory is
    left to join (v1 only: v2 cannot rename a cgroup)."""
    pooled = hier.create_pooled("7", os.getuid())
    if pooled is None:
        assert hier.version == "v2"
        return
    proc = _join(pooled)
    try:
        want_bpf = hier.bpf_dir() is not None
        cg = hier.claim(pooled, "s3", Resources(pids=64), bpf=want_bpf)
        assert cg.join == ([cg.bpf_dir] if want_bpf else [])
        assert cg.stats()["pids"] == 1  # the task came along
        assert hier.existing() == {"s3"}
    finally:
        proc.kill()
        proc.wait()
    cg.remove()


def test_v2_readers_on_a_fake_tree(tmp_path: Path) -> None:
    d = tmp_path / "sb"
    d.mkdir()
    for name, text in {"memory.current": "4096\n", "pids.current": "3\n",
                       "cpu.stat": "usage_usec 250\nnr_throttled 7\n",
                       "memory.events": "low 0\noom 1\noom_kill 2\n",
                       "pids.events": "max 5\n", "cgroup.events": "populated 1\nfrozen 1\n",
                       "cgroup.freeze": "", "cgroup.kill": ""}.items():
        (d / name).write_text(text)
    cg = V2Cgroup({"v2": d}, d)
    assert cg.stats() == {"memory_bytes": 4096, "cpu_usage_ns": 250_000, "pids": 3}
    assert cg.limit_counters() == {"pids_limit": 5, "cpu_throttled": 7, "oom_kill": 2}
    assert cg.frozen() and cg.sbx_init_dirs() == {"v2": d}
    t0 = time.monotonic()
    cg.freeze(True)  # cgroup.events already says frozen
    assert (d / "cgroup.freeze").read_text() == "1" and time.monotonic() - t0 < 1
    cg.kill_all()
    assert (d / "cgroup.kill").read_text() == "1" and (d / "cgroup.freeze").read_text() == "0"


def test_v2_memory_side_on_a_fake_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cgroup v2 path of density, checked on a v1 host with a fake cgroupfs (writes
    create their file, as mkdir makes them in a real one): a sandbox's memory.max,
    memory.swap.max (its share of swap), cpu.idle by class; the cap on all sandboxes; reclaim
    through memory.reclaim; usage with the CPU wait from the cgroup's cpu.pressure. Facts
    from Documentation/admin-guide/cgroup-v2.rst and accounting/psi.rst."""
    from edged.cgroups.v2 import V2Hierarchy

    def write(path: Path, value: str) -> None:
        path.write_text(value)

    chowned: list[Path] = []
    monkeypatch.setattr(fs, "write", write)
    monkeypatch.setattr(os, "chown", lambda p, uid, gid: chowned.append(Path(p)))
    base = tmp_path / "base"
    base.mkdir()
    (base / "cgroup.procs").write_text("")
    (base / "memory.reclaim").write_text("")
    h = V2Hierarchy(base / "edged", swap_share=0.5)
    res = Resources(cpus=0.5, memory_bytes=256 << 20, swap_bytes=0, pids=64)
    cg = h.create("s1", res, os.getuid(), qos="best_effort")
    d = base / "edged" / "s1"
    assert (base / "daemon").is_dir()  # "no internal processes": the daemon in a leaf
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    got = {f: (d / f).read_text() for f in ("cpu.max", "memory.max", "memory.swap.max",
                                            "pids.max", "cpu.idle")}
    assert got == {"cpu.max": "50000 100000", "memory.max": str(256 << 20),
                   "memory.swap.max": str(128 << 20), "pids.max": "64", "cpu.idle": "1"}
    # the spawner joins the sandbox's directory: sbx-init's cgroup namespace is rooted there,
    # so its per-exec cgroups are inside it (nsdelegate refuses moves across it)
    assert cg.join == [d]
    assert {p.relative_to(d) for p in chowned} == {  # delegated to sandbox root
        Path("."), Path("cgroup.procs"), Path("cgroup.subtree_control"), Path("cgroup.threads"),
        Path("init"), Path("init/cgroup.procs")}
    h.create("s2", res, os.getuid(), qos="latency_sensitive")
    assert (base / "edged" / "s2" / "cpu.idle").read_text() == "0"
    h.set_memory_limit(1 << 30)
    assert (base / "edged" / "memory.max").read_text() == str(1 << 30)
    h.set_memory_limit(0)
    assert (base / "edged" / "memory.max").read_text() == "max"
    assert h.features()["memory_reclaim"] is True
    # reclaim: the kernel's memory.reclaim, nbytes as asked
    (base / "edged" / "memory.reclaim").write_text("")
    assert cg.reclaim(12 << 20) is True
    assert (d / "memory.reclaim").read_text() == str(12 << 20)
    for name, text in {"memory.current": f"{20 << 20}\n", "memory.swap.current": f"{9 << 20}\n",
                       "memory.stat": f"anon {8 << 20}\nfile {6 << 20}\nshmem {2 << 20}\n"
                                      "pgmajfault 17\n",
                       "cpu.stat": "usage_usec 5000\n",
                       "cpu.pressure": "some avg10=1.00 avg60=0.50 avg300=0.10 total=7000\n"
                                       "full avg10=0.00 avg60=0.00 avg300=0.00 total=10\n"}.items():
        (d / name).write_text(text)
    use = cg.memory_usage()
    assert (use.resident_bytes, use.anon_bytes, use.file_bytes, use.shmem_bytes,
            use.swap_bytes, use.major_faults, use.cpu_usage_ns, use.cpu_wait_ns) == (
        20 << 20, 8 << 20, 4 << 20, 2 << 20, 9 << 20, 17, 5_000_000, 7_000_000)


def test_v1_cpu_wait_is_the_threads_run_delay(tmp_path: Path) -> None:
    """v1 has no per-cgroup PSI: the CPU wait is the sum of the listed threads' run-queue
    delay (/proc/<tid>/schedstat); threads gone are left out."""
    tasks = tmp_path / "tasks"
    me = os.getpid()
    tasks.write_text(f"{me}\n999999999\n")
    want = int(Path(f"/proc/{me}/schedstat").read_text().split()[1])
    got = fs.run_delay_ns(tasks)
    assert want <= got <= want + 10**9
    assert fs.run_delay_ns(tmp_path / "missing") == 0


def test_v2_a_daemon_in_its_predecessors_leaf_shares_its_base(tmp_path: Path) -> None:
    """A daemon moves its cgroup's processes into a ``daemon`` leaf before enabling the
    controllers for sandboxes. A later daemon in that process (a restart in place, the
    tests' daemons) took the leaf for a base of its own: each nested one level deeper (45
    in the node VM's run) and a restarted daemon looked for its predecessor's sandboxes
    beneath the leaf, adopting none. Both now share the base (a fake cgroupfs)."""
    root = tmp_path / "cg"
    unit = root / "system.slice" / "edged.service"
    leaf = unit / "daemon"
    leaf.mkdir(parents=True)
    for d in (root, unit, leaf):
        (d / "cgroup.controllers").write_text("cpu memory pids\n")
    (unit / "cgroup.subtree_control").write_text("")
    fresh = V2Hierarchy.probe(root, "edged", {"": "/system.slice/edged.service"})
    assert fresh is not None and fresh.parents["v2"] == unit / "edged"
    # before our first daemon enabled the controllers, a leaf named so is nobody's
    assert V2Hierarchy.probe(root, "edged", {"": "/system.slice/edged.service/daemon"}
                             ).parents["v2"] == leaf / "edged"
    (unit / "cgroup.subtree_control").write_text("cpu memory pids\n")
    again = V2Hierarchy.probe(root, "edged", {"": "/system.slice/edged.service/daemon"})
    assert again is not None and again.parents["v2"] == unit / "edged"
