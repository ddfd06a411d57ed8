"""MicroVM sandboxes: create→first exec from a template clone vs a cold boot vs a container,
exec round trips, host memory per idle microVM, pause→resume. One run, one machine.

    .venv/bin/python bench/bench_microvm.py [--n 20] [--cold 3] [--idle 20] [--many 100]
                                            [--cold-idle 10] [--tb-alt 16] [--json]

Needs root, QEMU and the guest kit (scripts/install.sh). Guest: Debian's cloud kernel, the
initramfs with this checkout's sbx-init, 256 MiB, 1 vCPU, TCG (KVM where the probe finds it
working), one busybox EROFS layer disk + a 1 GiB sparse ext4 upper disk. What is timed:

- create→first exec: from "make the upper disk" to the end of `true` in the guest: template
  clone (upper disk copied from the template's, QEMU start, state load, guest boot record:
  the layers' mounts and the overlay, HELLO; where it went, p50, and the QEMU process's CPU
  for it, ``qemu_cpu``) vs a clone started ahead (what a pool of waiting VMMs would hand
  out: VMM up, state loaded, guest waiting; timed from binding the layers under its
  placeholder disks: ``GuestVm.prestart``/``from_prestarted``) vs cold boot (the same with
  the kernel booted) vs the container backend on the same layer (mounted file-backed) with
  the daemon's default task profile;
- the same through the backend (what the daemon's create does: policy, uid slot, cgroups,
  meta, then a template clone), create→first exec→delete in a row, without the pool and
  with its default 2 clones started ahead per machine (refilled in the background between
  creates; ``hits``: creates that got one);
- exec round trip: `true`, guest vs container, after the first;
- host memory per idle microVM: MemAvailable before and after N clones are up and idle
  (each wrote 60 MiB to its tmpfs and removed it: memory the guest freed), divided by N, and
  the QEMU processes' PSS/RSS: template clones (sharing the template's RAM) with and without
  free page reporting and at a smaller TCG translation cache (``--tb-alt``), ``--many``
  clones (e.g. 100: the figure at scale), and cold boots (anonymous RAM, nothing shared)
  with and without free page reporting.
  MemAvailable is node-wide: other work on the machine moves it (the PSS sum is each VM's
  own);
- pause → resume: snapshot to a file and VMM exit, then restore to a first exec; what a
  paused VM keeps (its snapshot file; its host memory is freed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import edged
from edged.backends.base import ExecEnd, ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend
from edged.backends.microvm import accel, boot, guestkit
from edged.backends.microvm.backend import MicroVmBackend
from edged.backends.microvm.guest import GuestVm
from edged.backends.microvm.qemu import QemuVmm
from edged.backends.microvm.template import Templates
from edged.backends.microvm.vmm import Machine
from layerfs.mount import mounted_erofs
from layerfs.sources.directory import load_directory
from layerfs.writer import write_image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_create import busybox_tree

ENV = {"PATH": "/bin"}
SBX_INIT = Path(edged.__file__).resolve().parent / "_bin" / "sbx-init"


def busybox_layer(tmp: Path) -> Path:
    out = tmp / "rootfs.erofs"
    (tmp / "rootfs").mkdir()
    write_image(load_directory(busybox_tree(tmp / "rootfs" / "r")), out)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(xs) * 1e3, "p99_ms": pct(xs, 99) * 1e3,
            "min_ms": min(xs) * 1e3, "n": len(xs)}


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def rollup(pid: int) -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            k, v, *_ = line.split()
            out[k.rstrip(":")] = int(v) * 1024
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (s; /proc/<pid>/stat fields 14-15)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spec(i: int) -> boot.BootSpec:
    return boot.BootSpec(nlayers=1, hostname=f"vm{i}", realtime_ns=time.time_ns(),
                         memory_max=200 << 20, pids_max=1024, caps=None)


async def first_exec(g: GuestVm) -> None:
    end, _o, err = await g.run(["true"])
    assert end.exit_code == 0, (end, err)


async def bench_create(templates: Templates, machine: Machine, layer: Path, work: Path,
                       n: int, cold: int) -> dict[str, Any]:
    t = await templates.get(machine)
    clone_lat: list[float] = []
    rt: list[float] = []
    phases: list[dict[str, float]] = []
    for i in range(n):
        t0 = time.perf_counter()
        g = await GuestVm.clone(templates, t, [str(layer)], work / f"c{i}", spec(i))
        t1 = time.perf_counter()
        await first_exec(g)
        clone_lat.append(time.perf_counter() - t0)
        ph = dataclasses.asdict(g.timings)
        ph.update({f"guest:{k}": v for k, v in ph.pop("guest_steps").items()})
        ph["first_exec"] = time.perf_counter() - t1
        # the VMM's CPU for the create and its first exec: less sensitive to the load than
        # the wall time (under TCG a create is CPU-bound in its QEMU)
        ph["qemu_cpu"] = cpu_seconds(g.vm.pid)
        phases.append(ph)
        for _ in range(5):
            t1 = time.perf_counter()
            await first_exec(g)
            rt.append(time.perf_counter() - t1)
        await g.destroy()
    # a clone started ahead (as a pool of waiting VMMs would hold it): VMM up, state loaded,
    # guest waiting; timed from binding the layers to the end of the first exec
    pre_lat: list[float] = []
    pre_cpu: list[float] = []
    for i in range(n):
        d = work / f"w{i}"
        vm = await GuestVm.prestart(templates, t, d)
        await asyncio.sleep(0.3)  # waiting in the pool
        cpu0 = cpu_seconds(vm.pid)
        t0 = time.perf_counter()
        g = await GuestVm.from_prestarted(vm, t, [str(layer)], d, spec(i))
        await first_exec(g)
        pre_lat.append(time.perf_counter() - t0)
        pre_cpu.append(cpu_seconds(g.vm.pid) - cpu0)
        await g.destroy()
    cold_lat = []
    for i in range(cold):
        t0 = time.perf_counter()
        g = await GuestVm.cold_boot(templates.vmm, machine, [str(layer)], work / f"k{i}",
                                    spec(i))
        await first_exec(g)
        cold_lat.append(time.perf_counter() - t0)
        await g.destroy()
    phase_p50 = {k: statistics.median(p.get(k, 0.0) for p in phases) * 1e3
                 for k in dict.fromkeys(k for p in phases for k in p)}
    return {"template_boot_s": t.boot_s, "clone": summary(clone_lat),
            "clone_phases_p50_ms": phase_p50, "prestarted": summary(pre_lat),
            "prestarted_qemu_cpu_p50_ms": statistics.median(pre_cpu) * 1e3,
            "cold": summary(cold_lat),
            "guest_exec_rt": summary(rt)}


async def bench_backend(layer: Path, work: Path, n: int, accel_name: str,
                        pools: tuple[int, ...] = (0, 2)) -> dict[str, Any]:
    """create→first exec through the backend (what the daemon does: policy, uid slot,
    cgroups, meta, template clone or a clone from the pool), then delete, ``n`` times in a
    row per pool size in ``pools`` (0: no pool); the pool refills in the background
    between creates as it would on a node. ``hits``: creates that got a pooled clone."""
    out: dict[str, Any] = {}
    for size in pools:
        b = MicroVmBackend(work / f"b{size}" / "run", work / f"b{size}" / "state",
                           cache_dir=work / "cache", accel=accel_name, pool=size)

        def sb(sid: str) -> SandboxSpec:
            return SandboxSpec(id=sid, lowers=(str(layer),), resources=Resources(
                memory_bytes=160 << 20, disk_bytes=1 << 30), env=ENV, hostname=sid,
                qos="latency_sensitive")

        async def true(sid: str, b: MicroVmBackend = b) -> None:
            h = await b.exec(sid, ExecSpec(argv=("true",), env=ENV))
            async for ev in h.events():
                if isinstance(ev, ExecEnd):
                    assert ev.exit_code == 0, ev

        lat: list[float] = []
        hits = 0
        try:
            await b.create(sb("warm"))  # the template (booted once), the pool's machine
            await true("warm")
            await b.destroy("warm")
            await asyncio.sleep(3.0 if size else 0.0)  # the pool fills once
            for i in range(n):
                sid = f"p{size}-{i}"
                ready = {p.pid for p in b.pool.waiting()}
                t0 = time.perf_counter()
                await b.create(sb(sid))
                await true(sid)
                lat.append(time.perf_counter() - t0)
                guest = b._get(sid).guest
                hits += guest is not None and guest.vm.pid in ready
                await b.destroy(sid)
        finally:
            await b.cleanup_leftovers(set())
            await b.close()
        out[f"pool_{size}"] = {**summary(lat), "hits": hits}
    return out


async def bench_container(layer: Path, work: Path, n: int) -> dict[str, Any]:
    b = ContainerBackend(work / "state")
    await b.warm()
    lat, rt = [], []

    async def run_true(sid: str) -> None:
        h = await b.exec(sid, ExecSpec(argv=("true",), env=ENV))
        async for ev in h.events():
            if isinstance(ev, ExecEnd):
                assert ev.exit_code == 0, ev

    with mounted_erofs(layer) as mp:
        try:
            for i in range(n):
                sid = f"cb{i}"
                t0 = time.perf_counter()
                await b.create(SandboxSpec(id=sid, lowers=(mp,), resources=Resources(),
                                           env=ENV, hostname=sid))
                await run_true(sid)
                lat.append(time.perf_counter() - t0)
                for _ in range(5):
                    t1 = time.perf_counter()
                    await run_true(sid)
                    rt.append(time.perf_counter() - t1)
                await b.destroy(sid)
        finally:
            await b.cleanup_leftovers(set())
            await b.close()
    return {"create": summary(lat), "exec_rt": summary(rt)}


async def idle_memory(start: Any, count: int, settle_s: float) -> dict[str, Any]:
    """Start ``count`` VMs with ``start(i)`` (each runs one exec), let them idle, measure."""
    before = mem_available()
    vms: list[GuestVm] = []
    try:
        sem = asyncio.Semaphore(4)

        async def one(i: int) -> None:
            async with sem:
                g = await start(i)
                vms.append(g)
                # a burst: 60 MiB written to the guest's tmpfs and freed again, which free
                # page reporting hands back to the host and nothing else does
                end, _o, err = await g.run(["sh", "-c", "dd if=/dev/zero of=/dev/shm/x bs=1M "
                                            "count=60 2>/dev/null; rm /dev/shm/x"])
                assert end.exit_code == 0, (end, err)

        await asyncio.gather(*(one(i) for i in range(count)))
        await asyncio.sleep(settle_s / 2)
        cpu0, t0 = sum(cpu_seconds(g.vm.pid) for g in vms), time.monotonic()
        await asyncio.sleep(settle_s / 2)
        cpu = sum(cpu_seconds(g.vm.pid) for g in vms) - cpu0
        after = mem_available()
        rolls = [rollup(g.vm.pid) for g in vms]
        return {
            "vms": count,
            # what idle guests cost the host's CPU (their timers, under TCG)
            "cpu_per_idle_vm_pct": 100 * cpu / (time.monotonic() - t0) / count,
            "memavailable_drop_per_vm_mib": (before - after) / count / 2**20,
            "pss_per_vm_mib": statistics.mean(r.get("Pss", 0) for r in rolls) / 2**20,
            "rss_per_vm_mib": statistics.mean(r.get("Rss", 0) for r in rolls) / 2**20,
            "private_per_vm_mib": statistics.mean(
                r.get("Private_Dirty", 0) + r.get("Private_Clean", 0) for r in rolls) / 2**20,
            "anon_per_vm_mib": statistics.mean(r.get("Anonymous", 0) for r in rolls) / 2**20,
        }
    finally:
        await asyncio.gather(*(g.destroy() for g in vms), return_exceptions=True)


async def bench_memory(templates: Templates, machine: Machine, layer: Path, work: Path,
                       idle: int, many: int, settle_s: float, cold_idle: int = 10,
                       tb_alt: int = 16) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fpr = dataclasses.replace(machine, free_page_reporting=True)
    t = await templates.get(machine)
    t_fpr = await templates.get(fpr)

    def clone_of(tmpl: Any, tag: str) -> Any:
        async def start(i: int) -> GuestVm:
            return await GuestVm.clone(templates, tmpl, [str(layer)], work / f"{tag}{i}",
                                       spec(i))
        return start

    def cold_of(m: Machine, tag: str) -> Any:
        async def start(i: int) -> GuestVm:
            return await GuestVm.cold_boot(templates.vmm, m, [str(layer)], work / f"{tag}{i}",
                                           spec(i))
        return start

    out["clone"] = await idle_memory(clone_of(t, "c"), idle, settle_s)
    # QEMU 7.2 cannot discard a clone's private file RAM (see vmm.Machine): no gain expected
    out["clone_fpr"] = await idle_memory(clone_of(t_fpr, "f"), idle, settle_s)
    if tb_alt and machine.accel == "tcg":
        # TCG's translation cache per VM (its own template: the size is part of the machine)
        alt = dataclasses.replace(machine, tb_size_mib=tb_alt)
        out[f"clone_tb{tb_alt}"] = await idle_memory(clone_of(await templates.get(alt), "t"),
                                                     idle, settle_s)
    cold = max(2, min(idle // 2, cold_idle))
    out["cold_no_sharing"] = await idle_memory(cold_of(machine, "k"), cold, settle_s)
    out["cold_no_sharing_fpr"] = await idle_memory(cold_of(fpr, "q"), cold, settle_s)
    if many:
        out[f"clone_{many}"] = await idle_memory(clone_of(t, "M"), many, settle_s)
    return out


async def bench_pause(templates: Templates, machine: Machine, layer: Path,
                      work: Path, n: int = 3) -> dict[str, Any]:
    t = await templates.get(machine)
    pause_s, resume_s, snap, freed, pss_before, pss_after = [], [], [], [], [], []
    for i in range(n):
        g = await GuestVm.clone(templates, t, [str(layer)], work / f"p{i}", spec(i))
        try:
            await first_exec(g)
            await asyncio.sleep(2)
            pss_before.append(rollup(g.vm.pid).get("Pss", 0))
            m0 = mem_available()
            t0 = time.perf_counter()
            await g.pause(work / f"p{i}.snap")
            pause_s.append(time.perf_counter() - t0)
            freed.append(mem_available() - m0)
            snap.append((work / f"p{i}.snap").stat().st_size)
            t1 = time.perf_counter()
            await g.resume(templates.vmm, machine, work / f"p{i}.snap")
            await first_exec(g)
            resume_s.append(time.perf_counter() - t1)
            await asyncio.sleep(2)
            pss_after.append(rollup(g.vm.pid).get("Pss", 0))
        finally:
            await g.destroy()
            with contextlib.suppress(FileNotFoundError):
                (work / f"p{i}.snap").unlink()
    return {"pause": summary(pause_s), "resume_to_exec": summary(resume_s),
            "snapshot_mib": statistics.median(snap) / 2**20,
            "memavailable_freed_by_pause_mib": statistics.median(freed) / 2**20,
            "pss_before_pause_mib": statistics.median(pss_before) / 2**20,
            "pss_after_resume_mib": statistics.median(pss_after) / 2**20}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    kit = guestkit.load()
    tmp = Path(tempfile.mkdtemp(prefix="bench-microvm-"))
    try:
        layer = busybox_layer(tmp)
        initrd = guestkit.build_initramfs(kit, SBX_INIT, tmp / "initrd")
        machine = Machine(str(kit.kernel), str(initrd), guestkit.cmdline(), memory_mib=256,
                          ndisks=2)
        vmm = QemuVmm()
        probe = await accel.probe(vmm, machine, tmp / "run")
        machine = dataclasses.replace(machine, accel=probe.accel)
        templates = Templates(vmm, tmp / "templates", tmp / "run")
        res: dict[str, Any] = {"accel": probe.accel, "accel_reason": probe.reason,
                               "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]}
        if args.only != "memory":
            res["microvm"] = await bench_create(templates, machine, layer, tmp / "c", args.n,
                                                args.cold)
            res["backend"] = await bench_backend(layer, tmp / "b", args.n, probe.accel)
            res["container"] = await bench_container(layer, tmp / "k", args.n)
        if args.only != "speed":
            res["memory"] = await bench_memory(templates, machine, layer, tmp / "m",
                                               args.idle, args.many, args.settle,
                                               args.cold_idle, args.tb_alt)
        if args.only == "all":
            res["pause"] = await bench_pause(templates, machine, layer, tmp / "p")
        res["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        templates.close()
        if args.only != "memory":
            mv, ct = res["microvm"], res["container"]
            res["ratios"] = {
                "clone_vs_cold_p50": mv["clone"]["p50_ms"] / mv["cold"]["p50_ms"],
                "prestarted_vs_clone_p50": mv["prestarted"]["p50_ms"] / mv["clone"]["p50_ms"],
                "backend_pool_vs_no_pool_p50": res["backend"]["pool_2"]["p50_ms"]
                / res["backend"]["pool_0"]["p50_ms"],
                "clone_vs_container_p50": mv["clone"]["p50_ms"] / ct["create"]["p50_ms"],
                "guest_vs_container_exec_rt_p50":
                    mv["guest_exec_rt"]["p50_ms"] / ct["exec_rt"]["p50_ms"],
            }
        if args.only == "speed":
            return res
        top = res["memory"].get(f"clone_{args.many}", res["memory"]["clone"])
        per_vm, cpu_pct = top["pss_per_vm_mib"], top["cpu_per_idle_vm_pct"]
        res["wall"] = {
            "at_vms": top["vms"],
            "idle_vms_by_pss": int(mem_available() / (per_vm * 2**20)) if per_vm else None,
            "idle_vms_by_cpu": int(100 * (os.cpu_count() or 1) / cpu_pct) if cpu_pct else None,
            "cause": "per-VM QEMU heap and TCG state (anonymous memory of each VMM), "
                     "not guest RAM: see anon_per_vm_mib; and each idle guest's timer "
                     "CPU under TCG: cpu_per_idle_vm_pct",
        }
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="clone and container creates")
    ap.add_argument("--cold", type=int, default=3, help="cold boots")
    ap.add_argument("--idle", type=int, default=20, help="idle VMs for the memory figures")
    ap.add_argument("--many", type=int, default=0, help="also measure this many idle clones")
    ap.add_argument("--cold-idle", type=int, default=10,
                    help="idle cold boots for the no-sharing memory rows (at most --idle/2)")
    ap.add_argument("--tb-alt", type=int, default=16,
                    help="also idle clones at this TCG translation cache (MiB; 0: not)")
    ap.add_argument("--settle", type=float, default=8.0, help="idle seconds before measuring")
    ap.add_argument("--only", choices=("all", "memory", "speed"), default="all",
                    help="memory: only the idle-memory rows; speed: only create->first "
                    "exec and exec round trips (a minute or two)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_microvm: needs root", file=sys.stderr)
        return 2
    res = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"accel: {res['accel']} ({res['accel_reason'][:80]}); loadavg "
          f"{' '.join(res['loadavg_start'])} -> {' '.join(res['loadavg_end'])}")
    if args.only != "memory":
        print_speed(res)
    if args.only == "speed":
        return 0
    print(f"{'idle memory per VM (MiB)':32} {'MemAvail':>9} {'PSS':>7} {'RSS':>7} {'anon':>7} "
          f"{'CPU %':>6}")
    for name, m in res["memory"].items():
        print(f"{name + ' x' + str(m['vms']):32} {m['memavailable_drop_per_vm_mib']:9.1f} "
              f"{m['pss_per_vm_mib']:7.1f} {m['rss_per_vm_mib']:7.1f} "
              f"{m['anon_per_vm_mib']:7.1f} {m['cpu_per_idle_vm_pct']:6.2f}")
    w = res["wall"]
    print(f"wall (from {w['at_vms']} idle VMs): ~{w['idle_vms_by_pss']} by the memory available "
          f"now, ~{w['idle_vms_by_cpu']} by CPU; {w['cause']}")
    return 0


def print_speed(res: dict[str, Any]) -> None:
    mv, ct = res["microvm"], res["container"]
    print(f"{'create -> first exec':32} {'p50 ms':>9} {'p99 ms':>9} {'n':>4}")
    for name, s in (("template clone", mv["clone"]),
                    ("clone started ahead (a pool's)", mv["prestarted"]),
                    ("cold boot", mv["cold"]), ("container", ct["create"])):
        print(f"{name:32} {s['p50_ms']:9.1f} {s['p99_ms']:9.1f} {s['n']:4d}")
    for name, s in res["backend"].items():
        label = f"backend, {name.replace('_', ' ')} ({s['hits']} pooled)"
        print(f"{label:32} {s['p50_ms']:9.1f} {s['p99_ms']:9.1f} {s['n']:4d}")
    print("clone phases p50 (ms): " + ", ".join(
        f"{k} {v:.1f}" for k, v in mv["clone_phases_p50_ms"].items()))
    print(f"QEMU CPU per create + first exec p50: clone "
          f"{mv['clone_phases_p50_ms']['qemu_cpu']:.0f} ms, started ahead "
          f"{mv['prestarted_qemu_cpu_p50_ms']:.0f} ms (from the layers' bind)")
    print(f"exec round trip p50: guest {mv['guest_exec_rt']['p50_ms']:.2f} ms, container "
          f"{ct['exec_rt']['p50_ms']:.2f} ms")
    p = res.get("pause")
    if p is not None:
        print(f"pause p50 {p['pause']['p50_ms']:.0f} ms, resume->exec p50 "
              f"{p['resume_to_exec']['p50_ms']:.0f} ms, snapshot {p['snapshot_mib']:.1f} MiB, "
              f"freed {p['memavailable_freed_by_pause_mib']:.1f} MiB; PSS before "
              f"{p['pss_before_pause_mib']:.1f} -> after resume "
              f"{p['pss_after_resume_mib']:.1f} MiB")
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in res["ratios"].items()))


if __name__ == "__main__":
    sys.exit(main())
