"""The pool of clones started ahead (:mod:`edged.backends.microvm.pool`) on real guests
(marked ``vm``): a create takes one and it becomes the sandbox whole (identity, cgroups,
disks, logs); a clone that dies while it waits is replaced and never handed out; a daemon
that stops ends its clones, and one that restarts adopts none and removes an earlier
daemon's; a drain ends them all."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edged.backends.microvm.backend import MicroVmBackend, _PoolVm
from edged.cgroups import POOL_PREFIX

from .conftest import run, vmm_processes
from .test_backend import MakeBackend, sh, spec

pytestmark = [pytest.mark.vm, pytest.mark.root]

#: A daemon's backend on the test's dirs (argv: short dir, template cache, layer) that
#: adopts "kept", creates "other", says "full" once its pool is and waits to be killed.
CRASHED = """
import asyncio, sys, time
from pathlib import Path
from edged.backends.microvm.backend import MicroVmBackend
from tests.edged.backends.microvm.test_backend import spec
d, cache, layer = map(Path, sys.argv[1:])
async def main():
    b = MicroVmBackend(d / "run", d / "state", cache_dir=cache, accel="tcg", pool=1)
    await b.adopt("kept")
    await b.create(spec(layer, sid="other"))
    while b.pool.count() < 1:
        await asyncio.sleep(0.05)
    print("full", flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


async def pooled(b: MicroVmBackend, n: int = 1, timeout: float = 120.0) -> list[_PoolVm]:
    """Wait until ``n`` clones wait in ``b``'s pool; returns them."""
    deadline = time.monotonic() + timeout
    while b.pool.count() < n:
        assert time.monotonic() < deadline, f"pool has {b.pool.count()} clones, not {n}"
        await asyncio.sleep(0.05)
    return b.pool.waiting()


async def finish(b: MicroVmBackend, *sids: str) -> None:
    """Delete ``sids`` and close ``b`` in this loop (its clones' connections are this
    loop's)."""
    for sid in sids:
        await b.destroy(sid)
    await b.close()


def pool_cgroups(b: MicroVmBackend) -> list[Path]:
    return [d for p in b.cgroups.all_parents() if p.exists() for d in p.iterdir()
            if d.is_dir() and d.name.startswith(POOL_PREFIX)]


def test_a_create_takes_a_pooled_clone_that_becomes_the_sandbox_whole(
        make_backend: MakeBackend, layer: Path) -> None:
    b = make_backend(pool=1)

    async def body() -> None:
        await b.create(spec(layer, sid="first"))
        try:
            [p] = await pooled(b)
            # while it waits: its own slot's uid, cgroups .pool-<slot>, dirs under pool/
            assert os.stat(f"/proc/{p.pid}").st_uid == b.uid_base + p.slot * b.id_count
            assert p.run_dir == b.pool_run / str(p.slot) and (p.run_dir / "ctl.sock").exists()
            assert (p.data_dir / "upper.img").is_file()
            assert {d.name for d in p.cg.dirs.values()} == {f"{POOL_PREFIX}{p.slot}"}
            assert p.pid in {int(x) for x in (p.cg.dirs["memory"] / "cgroup.procs")
                             .read_text().split()}
            assert b.pool_bytes() > 1 << 20  # what it holds, for admission
            claim = b.uid_slots.read(p.slot)
            assert claim is not None and claim["init"][0] == p.pid

            await b.create(spec(layer, sid="second", cpus=0.5))
            vm = b._get("second")
            assert vm.guest is not None and vm.cg is not None
            assert vm.guest.vm.pid == p.pid and vm.slot == p.slot  # the pooled clone
            # its identity, cgroups, disks and logs are the sandbox's now
            claim = b.uid_slots.read(p.slot)
            assert claim is not None and claim["sandbox"] == "second"
            assert {d.name for d in vm.cg.dirs.values()} == {"second"}
            assert p.pid in {int(x) for x in (vm.cg.dirs["memory"] / "cgroup.procs")
                             .read_text().split()}
            if vm.cg.version == "v1":
                assert (vm.cg.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
                limit = int((vm.cg.dirs["memory"] / "memory.limit_in_bytes").read_text())
                assert limit == 2 * (256 << 20) + (160 << 20)
            run_dir = b.sandboxes_dir / "second"
            assert vm.run_dir == run_dir and vm.guest.vm.run_dir == run_dir
            for f in ("ctl.sock", "qmp.sock", "console.log", "qemu.log", "meta.json"):
                assert (run_dir / f).exists(), f
            assert (b.vms_dir / "second" / "upper.img").is_file()
            assert not (b.pool_run / str(p.slot)).exists()
            assert not (b.pool_data / str(p.slot)).exists()
            assert await b.list_existing() == ["first", "second"]
            # it runs the sandbox's layers, hostname and upper
            out, _, end = await sh(b, "second", "hostname; cat /etc/hostname; echo w > /w; "
                                   "cat /w")
            assert (out, end.exit_code) == (b"host-second\nlayer\nw\n", 0)
            # the pool fills again in the background, with another clone
            [q] = await pooled(b)
            assert q.pid != p.pid and q.slot != p.slot
            await b.pause("second")
            await b.resume("second")
            out, _, _ = await sh(b, "second", "cat /w")
            assert out == b"w\n"
        finally:
            await finish(b, "first", "second")

    run(body())


def test_a_pooled_clone_that_died_is_replaced_and_never_handed_out(
        make_backend: MakeBackend, layer: Path) -> None:
    b = make_backend(pool=1)

    async def body() -> None:
        await b.create(spec(layer, sid="first"))
        try:
            [p] = await pooled(b)
            dead = p.pid
            os.kill(dead, signal.SIGKILL)  # the backend's child, started by this test
            # at once: found dead at the take, or dying as it is taken (then the create
            # clones afresh), the sandbox never gets it
            await b.create(spec(layer, sid="second"))
            vm = b._get("second")
            assert vm.guest is not None and vm.guest.vm.pid != dead
            out, _, _ = await sh(b, "second", "echo ok")
            assert out == b"ok\n"
            [q] = await pooled(b)
            assert q.pid != dead and b.pool.replaced >= 1
            assert not (b.pool_run / str(p.slot)).exists() or q.slot == p.slot
            # killed while it waits (noticed by its pidfd): replaced
            os.kill(q.pid, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not b.pool.waiting() or b.pool.waiting()[0].pid == q.pid:
                assert time.monotonic() < deadline, "the dead clone was not replaced"
                await asyncio.sleep(0.05)
            assert b.pool.replaced >= 2
        finally:
            await finish(b, "first", "second")

    run(body())


def test_stop_ends_the_pool_and_a_restart_adopts_none_and_cleans_up(
        make_backend: MakeBackend, layer: Path) -> None:
    b1 = make_backend(pool=2)

    async def first() -> None:
        await b1.create(spec(layer, sid="kept"))
        ps = await pooled(b1, 2)
        assert len(vmm_processes(b1.pool_run)) == 2
        await b1.close()  # the daemon stops: its clones go, its sandbox stays
        for p in ps:
            assert not p.alive()
        assert not vmm_processes(b1.pool_run) and not pool_cgroups(b1)
        assert not [f for d in (b1.pool_run, b1.pool_data) if d.exists() for f in d.iterdir()]
        assert vmm_processes(b1.sandboxes_dir)

    run(first())
    b3 = make_backend(pool=1)
    # a daemon that dies (SIGKILL) with a full pool: a process of its own on the same dirs
    crashed = subprocess.Popen([sys.executable, "-c", CRASHED, str(b1.run_root.parents[1]),
                                str(b1.cache_dir), str(layer)], stdout=subprocess.PIPE)
    try:
        assert crashed.stdout is not None and crashed.stdout.readline() == b"full\n"
    finally:
        crashed.kill()
        crashed.wait()
        assert crashed.stdout is not None
        crashed.stdout.close()
    assert len(vmm_processes(b3.pool_run)) == 1 and pool_cgroups(b3)

    async def restarted() -> None:
        assert await b3.list_existing() == ["kept", "other"]  # no pool clone
        assert await b3.cleanup_leftovers({"kept", "other"}) == []
        assert not vmm_processes(b3.pool_run) and not pool_cgroups(b3)
        assert not [f for d in (b3.pool_run, b3.pool_data) if d.exists() for f in d.iterdir()]
        await b3.adopt("kept")
        await b3.adopt("other")
        out, _, _ = await sh(b3, "kept", "echo still")
        assert out == b"still\n"
        # short of memory: the pool is drained and not refilled for a while
        await b3.create(spec(layer, sid="third"))
        await pooled(b3)
        assert b3.drain_pool() == 1 and b3.pool.count() == 0
        deadline = time.monotonic() + 30
        while vmm_processes(b3.pool_run) or pool_cgroups(b3):
            assert time.monotonic() < deadline, "drained clones still there"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        assert b3.pool.count() == 0 and not vmm_processes(b3.pool_run)
        await finish(b3, "kept", "other", "third")

    run(restarted())
