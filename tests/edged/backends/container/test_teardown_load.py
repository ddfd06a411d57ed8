"""Destroy under host CPU contention: a sandbox starved by its own CPU quota (and, as
best-effort, SCHED_IDLE), full of busy processes, beside busy loops on the host, is still
deleted completely (issue 9 follow-up: "sbx-init did not exit after SIGKILL" at load 20-80)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.backends.base import ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend
from edged.cgroups.base import SandboxCgroup
from tests.edged.backends.container.conftest import cgroup_dirs, sandbox_processes
from tests.edged.execs import collect

pytestmark = [pytest.mark.root, pytest.mark.mount]

ENV = {"PATH": "/bin"}
BUSY = 100  # busy processes in the sandbox


@contextlib.contextmanager
def host_busy() -> Iterator[None]:
    """Busy loops on the host, 24 a CPU, at normal priority, in our own cgroup: where a
    best-effort sandbox's idle parent competes (killed by pid)."""
    n = 24 * (os.cpu_count() or 1)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def starve(cg: SandboxCgroup) -> None:
    """The sandbox's CPU quota set to 1 ms per 100 ms period (v1 ``cpu.cfs_quota_us``, v2
    ``cpu.max``)."""
    if cg.version == "v2":
        (cg.dirs["v2"] / "cpu.max").write_text("1000 100000")
    else:
        (cg.dirs["cpu"] / "cpu.cfs_quota_us").write_text("1000")


@pytest.mark.parametrize("qos", ["best_effort", "latency_sensitive"])
def test_destroy_of_a_starved_busy_sandbox_under_host_load_leaves_nothing(
        backend: ContainerBackend, busybox_tree: Path, qos: str) -> None:
    async def body() -> None:
        spec = SandboxSpec(id="sbload", lowers=(str(busybox_tree),),
                           resources=Resources(cpus=1.0), env=ENV, qos=qos, hostname="sbload")
        await backend.create(spec)
        script = (f"i=0; while [ $i -lt {BUSY} ]; do (while :; do :; done) & "
                  "i=$((i+1)); done; echo started")
        h = await backend.exec("sbload", ExecSpec(argv=("sh", "-c", script), env=ENV))
        out, _, end = await collect(h)
        assert out == b"started\n", end
        # then starve it: 1 % of a CPU (what ``cpus: 0.01`` sets; forking the loops at
        # that quota alone would take a minute)
        starve(backend._sandboxes["sbload"].cg)
        with host_busy():
            await asyncio.sleep(1)  # the busy loops at full speed
            await backend.destroy("sbload")  # raised, or hung, before (at load ~60)
        assert not sandbox_processes(backend), "sbx-init survived the destroy"
        assert not cgroup_dirs(backend), "destroy left cgroups"
        assert not (backend.sandboxes_dir / "sbload").exists(), "destroy left its state dir"

    asyncio.run(asyncio.wait_for(body(), 300))


def test_unthrottle_lifts_the_quota_and_the_idle_class(
        backend: ContainerBackend, busybox_tree: Path) -> None:
    """What the destroy does first: the dying sandbox's quota and idle class lifted, and
    (``leave_idle``) its processes out of the idle parent (v1; v2 has no idle parent: its
    own ``cpu.idle``)."""
    async def body() -> None:
        await backend.create(SandboxSpec(id="sbunth", lowers=(str(busybox_tree),),
                                         resources=Resources(cpus=0.01), env=ENV,
                                         qos="best_effort", hostname="sbunth"))
        try:
            cg = backend._sandboxes["sbunth"].cg
            if cg.version == "v2":  # one directory: quota and class lifted there
                d = cg.dirs["v2"]
                assert (d / "cpu.max").read_text().split() == ["1000", "100000"]
                assert (d / "cpu.idle").read_text().strip() == "1" and cg.procs()
                cg.unthrottle(leave_idle=True)
                assert (d / "cpu.max").read_text().split()[0] == "max"
                assert (d / "cpu.idle").read_text().strip() == "0"
                return
            cpu = cg.dirs["cpu"]
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "1000"
            assert cpu.parent.name.endswith("-idle") and cg.procs()
            cg.unthrottle()
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "-1"
            assert cg.procs() and set(cg.procs()) <= {
                int(p) for p in (cpu / "cgroup.procs").read_text().split()}
            cg.unthrottle(leave_idle=True)
            assert not (cpu / "cgroup.procs").read_text().split()
            normal = cpu.parent.with_name(cpu.parent.name.removesuffix("-idle"))
            assert set(cg.procs()) <= {
                int(p) for p in (normal / "cgroup.procs").read_text().split()}
        finally:
            await backend.destroy("sbunth")

    asyncio.run(asyncio.wait_for(body(), 120))
