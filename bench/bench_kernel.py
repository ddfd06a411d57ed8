"""Host kernel memory of an idle container sandbox, and of each kernel object it is made of:
what a sandbox costs with its spare exec child and after it has dropped it, in the same run.

    .venv/bin/python bench/bench_kernel.py [--n 200] [--spare-idle-s 60]
        [--only objects,sandboxes] [--json]

Needs root and busybox-static. Kernel memory is ``/proc/meminfo``'s SUnreclaim +
SReclaimable + KernelStack + PageTables + Percpu, and every slab cache
(``/proc/slabinfo``), read before and after ``--n`` of a thing were made; per thing: the
difference over ``--n``. Things, each made ``--n`` times, measured, then removed:
- ``memory cgroup``: an empty one beneath this process's own (v1 ``memory``, or v2);
- ``freezer cgroup`` (v1): what an exec's own cgroup is;
- ``tmpfs superblock``: in a private mount namespace (each superblock registers a shrinker,
  and every memory cgroup's shrinker tables are sized by the highest shrinker id);
- ``task``: a busybox ``sleep`` (a static binary: small page tables); ``task in a new X
  ns``: the same in a namespace of its own of each kind a sandbox has (the namespace's
  cost is the difference; a network namespace with its loopback up);
- ``sandbox + spare``: a container sandbox (``ContainerBackend``, a busybox tree as its
  layer, the backend's default limits) whose one exec started ``sleep`` in the background
  and ended; sbx-init has forked its spare for the next exec;
- ``sandbox``: the same ones once sbx-init dropped its spare (``--spare-idle-s`` after that
  exec: the daemon's config ``spare_idle_s``), and their ratio.
The machine's other work moves these figures (kernel memory is global): run it on a quiet
machine, and read the load average it prints. The per-memory-cgroup shrinker tables (kmalloc
1k) grow with the highest shrinker id the boot has seen, which only a reboot lowers: the
memory cgroup's figure says how far that is on this boot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_create import busybox_tree  # bench/ is this script's directory
from bench_density import KERNEL_FIELDS, Snap, per_sandbox

from edged.backends.base import ExecEnd, ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend

KiB = 1024
ENV = {"PATH": "/bin"}


def snap(n: int) -> Snap:
    time.sleep(1.0)  # RCU-freed objects of what was just torn down settle
    return Snap.take(n, None)


def own_cgroup(controller: str) -> Path | None:
    """This process's cgroup directory of a v1 ``controller`` ("" for v2), if mounted."""
    for ln in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = ln.split(":", 2)
        if (controller in ctrls.split(",")) if controller else ctrls == "":
            base = Path("/sys/fs/cgroup", controller) if controller else Path("/sys/fs/cgroup")
            if not controller and not (base / "cgroup.controllers").exists():
                base = Path("/sys/fs/cgroup/unified")
            d = base / path.lstrip("/")
            return d if d.is_dir() else None
    return None


@contextlib.contextmanager
def cgroups(parent: Path, n: int) -> Iterator[None]:
    top = parent / f"bench-kernel-{os.getpid()}"
    top.mkdir()
    try:
        for i in range(n):
            (top / f"c{i}").mkdir()
        yield
    finally:
        for i in range(n):
            with contextlib.suppress(FileNotFoundError):
                (top / f"c{i}").rmdir()
        top.rmdir()


@contextlib.contextmanager
def tmpfs_superblocks(tmp: Path, n: int) -> Iterator[None]:
    """``n`` tmpfs mounts in a mount namespace of a child's own (gone with the child)."""
    d = tmp / "mnt"
    d.mkdir()
    script = (f"for i in $(seq {n}); do mkdir -p {d}/$i && mount -t tmpfs -o size=1m t "
              f"{d}/$i || exit 1; done; echo ready; read x")
    p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", "mounts failed"
        yield
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(60)
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def tasks(n: int, unshare: tuple[str, ...] = ()) -> Iterator[None]:
    """``n`` busybox ``sleep`` processes, each in new namespaces of the ``unshare`` kinds
    (util-linux ``unshare`` execs it: the same task, the namespaces added)."""
    bb = shutil.which("busybox") or "/bin/busybox"
    pre = ["unshare", *(f"--{k}" for k in unshare)] if unshare else []
    if "pid" in unshare:
        pre.append("--kill-child")  # implies --fork; the sleep dies with unshare
    if "net" in unshare:  # loopback up, as a sandbox's netns has it
        argv = [*pre, "sh", "-c", f"ip link set lo up && exec {bb} sleep 100000"]
    else:
        argv = [*pre, bb, "sleep", "100000"]
    ps = [subprocess.Popen(argv) for _ in range(n)]
    try:
        time.sleep(2.0)  # each has made its namespaces and exec'd sleep
        yield
    finally:
        for p in ps:
            p.kill()
        for p in ps:
            p.wait()


def measure(name: str, n: int, cm: contextlib.AbstractContextManager[None]) -> dict[str, Any]:
    a = snap(0)
    with cm:
        b = snap(n)
    out = per_sandbox(a, b)
    out["thing"] = name
    return out


def inits(b: ContainerBackend, sid: str) -> int:
    """sbx-init and its spare (a fork of it) among the sandbox's tasks."""
    n = 0
    for p in b._sandboxes[sid].cg.procs():
        with contextlib.suppress(OSError):
            n += Path(f"/proc/{p}/comm").read_text().strip() == "sbx-init"
    return n


async def sandboxes(tree: Path, state: Path, n: int, idle_s: float,
                    conc: int = 4) -> list[dict[str, Any]]:
    """``n`` idle sandboxes: kernel memory per sandbox with the spare, then without."""
    b = ContainerBackend(state, spare_idle_s=idle_s)
    ids = [f"k{i}" for i in range(n)]
    a = snap(0)
    it = iter(ids)
    first_exec: float | None = None
    last_exec = time.monotonic()

    async def worker() -> None:
        nonlocal first_exec, last_exec
        for sid in it:
            await b.create(SandboxSpec(id=sid, lowers=(str(tree),), resources=Resources(),
                                       env=ENV, hostname=sid, qos="latency_sensitive"))
            h = await b.exec(sid, ExecSpec(argv=("sh", "-c", "sleep 100000 > /dev/null 2>&1 &"),
                                           env=ENV))
            async for ev in h.events():
                if isinstance(ev, ExecEnd) and ev.exit_code != 0:
                    raise RuntimeError(f"{sid}: {ev}")
            last_exec = time.monotonic()
            first_exec = first_exec or last_exec

    out: list[dict[str, Any]] = []
    try:
        await asyncio.gather(*(worker() for _ in range(conc)))
        assert first_exec is not None
        while any(inits(b, s) != 2 for s in ids) and time.monotonic() < first_exec + idle_s:
            await asyncio.sleep(0.2)
        with_spare = snap(n)
        if time.monotonic() - first_exec >= idle_s:
            raise RuntimeError(f"the fill took longer than --spare-idle-s ({idle_s} s): "
                               "some spares were dropped before they were counted")
        deadline = last_exec + idle_s + 120
        while any(inits(b, s) != 1 for s in ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        left = sum(inits(b, s) == 2 for s in ids)
        without = snap(n)
        out.append({**per_sandbox(a, with_spare), "thing": "sandbox + spare"})
        out.append({**per_sandbox(a, without), "thing": "sandbox", "spares_left": left})
        out.append({**per_sandbox(dataclasses.replace(without, n=0), with_spare),
                    "thing": "the spare (difference)"})
    finally:
        await asyncio.gather(*(b.destroy(s) for s in ids), return_exceptions=True)
        for p in b.cgroups.all_parents():
            with contextlib.suppress(OSError):
                p.rmdir()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="things of each kind")
    ap.add_argument("--spare-idle-s", type=float, default=60.0,
                    help="sbx-init drops its spare this long after the last exec")
    ap.add_argument("--only", default="", help="comma-separated: objects, sandboxes")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_kernel: needs root", file=sys.stderr)
        return 2
    only = set(filter(None, a.only.split(","))) or {"objects", "sandboxes"}
    load0 = os.getloadavg()
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kernel-"))
    rows: list[dict[str, Any]] = []
    try:
        if "objects" in only:
            v1 = own_cgroup("memory")
            mem = v1 or own_cgroup("")
            if mem:
                rows.append(measure("memory cgroup", a.n, cgroups(mem, a.n)))
            frz = own_cgroup("freezer")
            if v1 and frz:
                rows.append(measure("freezer cgroup", a.n, cgroups(frz, a.n)))
            rows.append(measure("tmpfs superblock", a.n, tmpfs_superblocks(tmp, a.n)))
            rows.append(measure("task", a.n, tasks(a.n)))
            for kinds in (("net",), ("ipc",), ("mount",), ("pid",), ("uts",), ("cgroup",),
                          ("user",)):
                rows.append(measure(f"task in a new {'+'.join(kinds)} ns", a.n,
                                    tasks(a.n, kinds)))
        if "sandboxes" in only:
            tree = busybox_tree(tmp / "rootfs")
            os.chmod(tree, 0o755)
            rows += asyncio.run(sandboxes(tree, tmp / "state", a.n, a.spare_idle_s))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
           "kernel": os.uname().release, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "duration_s": time.monotonic() - t0, "n": a.n, "rows": rows}
    by = {r["thing"]: r for r in rows}
    if "sandbox" in by and "sandbox + spare" in by and by["sandbox + spare"]["total"]:
        out["sandbox_over_sandbox_with_spare"] = (by["sandbox"]["total"]
                                                  / by["sandbox + spare"]["total"])
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"bench_kernel  {out['date']}  kernel {out['kernel']}  load average "
          f"{load0[0]:.2f} at start, {out['loadavg_end'][0]:.2f} at end; n = {a.n}")
    print(f"command: {out['command']}")
    head = f"{'KiB per thing':<24}{'total':>8}" + "".join(f"{k:>13}" for k in KERNEL_FIELDS)
    print(head)
    for r in rows:
        print(f"{r['thing']:<24}{r['total'] / KiB:>8.1f}"
              + "".join(f"{r['meminfo'][k] / KiB:>13.1f}" for k in KERNEL_FIELDS))
    for r in rows:
        caches = ", ".join(f"{c} {v / KiB:.1f}" for c, v in list(r["slabs"].items())[:8])
        print(f"  {r['thing']}: slab caches (KiB): {caches}")
    if "sandbox_over_sandbox_with_spare" in out:
        left = by["sandbox"].get("spares_left", 0)
        print(f"sandbox / sandbox + spare: {out['sandbox_over_sandbox_with_spare']:.2f}"
              f"{f' ({left} spares not dropped yet)' if left else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
