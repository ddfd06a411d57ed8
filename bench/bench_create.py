"""Sandbox create→first-exec latency and creates per second: edged's container backend against
`bwrap` and bare `unshare` + overlay mount, on the same rootfs layer, in the same run.

    .venv/bin/python bench/bench_create.py [--n 200] [--concurrency 4] [--erofs]
                                           [--spawner-pool N] [--json]

Needs root. The rootfs is a busybox-static tree (a plain directory; with --erofs, an EROFS
image of it built by layerfs and mounted file-backed). What each contender does per sandbox:
- edged: ContainerBackend.create (spawner: user/mount/pid/net/ipc/uts/cgroup namespaces,
  id-mapped lower, overlay on a size-limited tmpfs, /proc /dev /sys, pivot_root, sbx-init;
  cgroups with limits) then exec `true` until its end is reported; destroy is not timed.
  Configured as the daemon configures it: the daemon's default task profile (read-only
  protected paths, capability drop, Landlock and seccomp on each exec) and spawner pool
  (``--spawner-pool``, default the daemon's); "edged unconfined" is the same without a task
  profile.
- bwrap: `bwrap --unshare-all --ro-bind L / --tmpfs /tmp --proc /proc --dev /dev true`
  (Debian 12's bwrap 0.8 has no overlay option, so it does less than the others).
- unshare: `unshare -muinpfC sh -c 'mount tmpfs; mount overlay; chroot … true'`.
Latency: sequential, one at a time. creates/s: `--concurrency` at a time, for `--n` sandboxes
(edged: create+first exec; destroys run after the clock stops). "after idle" (edged): the same
two figures with `--idle-ms` of nothing before each (an agent thinking between commands): the
kernel's cgroup moves then find no recent grace period to ride on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from edged.backends.base import QOS_CLASSES, ExecEnd, ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend
from edged.config import Config

ENV = {"PATH": "/bin"}


def busybox_tree(root: Path) -> Path:
    bb = shutil.which("busybox") or "/bin/busybox"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(bb, root / "bin" / "busybox")
    for a in subprocess.run([bb, "--list"], capture_output=True, text=True).stdout.split():
        if a != "busybox":
            (root / "bin" / a).symlink_to("busybox")
    for d in ("proc", "dev", "sys", "tmp"):
        (root / d).mkdir()
    return root


@contextlib.contextmanager
def lower_dir(tmp: Path, erofs: bool) -> Iterator[str]:
    tree = busybox_tree(tmp / "rootfs")
    if not erofs:
        yield str(tree)
        return
    from layerfs.build import build_layer
    from layerfs.mount import mounted_erofs

    image = tmp / "rootfs.erofs"
    build_layer(str(tree), kind="base", store=None, output=str(image))
    with mounted_erofs(image) as mp:
        yield mp


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def run_edged(lower: str, state: Path, n: int, conc: int, profile: str | None,
                    pool: int, idle_s: float, qos: str) -> dict[str, Any]:
    b = ContainerBackend(state, spawner_pool=pool)
    try:
        return await _measure_edged(b, lower, n, conc, profile, idle_s, qos)
    finally:  # a failure leaves no sandbox behind (one create failing left 154 at load 70)
        for sid in await b.list_existing():
            await b.destroy(sid)
        await b.cleanup_leftovers(set())
        await b.close()


async def _measure_edged(b: ContainerBackend, lower: str, n: int, conc: int,
                         profile: str | None, idle_s: float, qos: str) -> dict[str, Any]:
    await b.warm()
    counter = 0

    async def one() -> tuple[str, float]:
        nonlocal counter
        counter += 1
        sid = f"b{counter}"
        t0 = time.perf_counter()
        await b.create(SandboxSpec(id=sid, lowers=(lower,), resources=Resources(), env=ENV,
                                   hostname=sid, task_profile=profile, qos=qos))
        h = await b.exec(sid, ExecSpec(argv=("true",), env=ENV))
        async for ev in h.events():
            if isinstance(ev, ExecEnd):
                assert ev.exit_code == 0, ev
        return sid, time.perf_counter() - t0

    lat = []
    exec_rt = []
    for _ in range(max(10, n // 2)):
        sid, dt = await one()
        lat.append(dt)
        for _ in range(3):
            t0 = time.perf_counter()
            h = await b.exec(sid, ExecSpec(argv=("true",), env=ENV))
            async for _ev in h.events():
                pass
            exec_rt.append(time.perf_counter() - t0)
        await b.destroy(sid)
    idle_lat, idle_rt = [], []
    for _ in range(10):
        await asyncio.sleep(idle_s)
        sid, dt = await one()
        idle_lat.append(dt)
        for _ in range(2):
            await asyncio.sleep(idle_s)
            t0 = time.perf_counter()
            h = await b.exec(sid, ExecSpec(argv=("true",), env=ENV))
            async for _ev in h.events():
                pass
            idle_rt.append(time.perf_counter() - t0)
        await b.destroy(sid)
    rate = await throughput(one, n, conc, b.destroy)
    return {"latencies": lat, "creates_per_s": rate, "exec_roundtrips": exec_rt,
            "idle_latencies": idle_lat, "idle_exec_roundtrips": idle_rt}


async def throughput(one: Callable[[], Awaitable[tuple[str, float]]], n: int, conc: int,
                     destroy: Callable[[str], Awaitable[None]] | None) -> float:
    sem = asyncio.Semaphore(conc)
    made: list[str] = []

    async def task() -> None:
        async with sem:
            sid, _ = await one()
            made.append(sid)

    t0 = time.perf_counter()
    # every create ends before any error is raised, so the finally below sees them all
    done = await asyncio.gather(*(task() for _ in range(n)), return_exceptions=True)
    rate = n / (time.perf_counter() - t0)
    try:
        for r in done:
            if isinstance(r, BaseException):
                raise r
    finally:
        if destroy is not None:
            for sid in made:
                await destroy(sid)
    return rate


Runner = Callable[[], Awaitable[tuple[str, float]]]


def command_runner(argv_for: Callable[[int], list[str]]) -> Runner:
    counter = 0

    async def one() -> tuple[str, float]:
        nonlocal counter
        counter += 1
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*argv_for(counter),
                                                    stdin=subprocess.DEVNULL)
        rc = await proc.wait()
        if rc != 0:
            raise RuntimeError(f"{argv_for(counter)[0]} exited {rc}")
        return str(counter), time.perf_counter() - t0

    return one


async def run_command(one: Callable[[], Awaitable[tuple[str, float]]], n: int,
                      conc: int) -> dict[str, Any]:
    lat = [(await one())[1] for _ in range(max(10, n // 2))]
    rate = await throughput(one, n, conc, None)
    return {"latencies": lat, "creates_per_s": rate}


def bwrap_argv(lower: str) -> Callable[[int], list[str]]:
    # bwrap < 0.9 has no --overlay-src: a read-only bind of the layer with a tmpfs /tmp
    return lambda i: ["bwrap", "--unshare-all", "--ro-bind", lower, "/", "--tmpfs", "/tmp",
                      "--proc", "/proc", "--dev", "/dev", "--hostname", f"b{i}", "/bin/true"]


def unshare_argv(lower: str, scratch: Path) -> Callable[[int], list[str]]:
    def argv(i: int) -> list[str]:
        d = scratch / f"u{i}"
        d.mkdir()
        script = (f"mount -t tmpfs -o size=1g tmpfs {d} && mkdir {d}/u {d}/w {d}/m && "
                  f"mount -t overlay overlay -o lowerdir={lower},upperdir={d}/u,workdir={d}/w "
                  f"{d}/m && exec chroot {d}/m /bin/true")
        return ["unshare", "-muinpfC", "--propagation", "private", "sh", "-c", script]

    return argv


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-create.") as tmp_s:
        tmp = Path(tmp_s)
        os.chmod(tmp, 0o755)
        with lower_dir(tmp, args.erofs) as lower:
            results: dict[str, Any] = {}
            idle = args.idle_ms / 1e3
            results["edged"] = await run_edged(lower, tmp / "state", args.n, args.concurrency,
                                               "default", args.spawner_pool, idle, args.qos)
            results["edged unconfined"] = await run_edged(lower, tmp / "state", args.n,
                                                          args.concurrency, None,
                                                          args.spawner_pool, idle, args.qos)
            if shutil.which("bwrap"):
                results["bwrap"] = await run_command(command_runner(bwrap_argv(lower)), args.n,
                                                     args.concurrency)
            scratch = tmp / "unshare"
            scratch.mkdir()
            results["unshare+overlay"] = await run_command(
                command_runner(unshare_argv(lower, scratch)), args.n, args.concurrency)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="sandboxes for creates/s")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--erofs", action="store_true", help="use an EROFS image as the lower")
    ap.add_argument("--spawner-pool", type=int, default=Config().spawner_pool,
                    help="edged's pooled spawners (default: the daemon's)")
    ap.add_argument("--idle-ms", type=float, default=50.0,
                    help="idle time before each 'after idle' sample")
    ap.add_argument("--qos", choices=QOS_CLASSES, default=SandboxSpec.qos,
                    help="edged's sandboxes' CPU class (default: the daemon's); best_effort "
                         "yields the CPU to every other process, so on a busy machine it "
                         "measures the others' load")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_create: needs root")
    res = asyncio.run(main_async(args))
    table = {}
    for name, r in res.items():
        lat = r["latencies"]
        table[name] = {"p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * pct(lat, 99),
                       "creates_per_s": r["creates_per_s"], "samples": len(lat)}
        if "exec_roundtrips" in r:
            table[name]["exec_roundtrip_p50_ms"] = 1e3 * statistics.median(r["exec_roundtrips"])
            table[name]["after_idle_p50_ms"] = 1e3 * statistics.median(r["idle_latencies"])
            table[name]["after_idle_exec_roundtrip_p50_ms"] = 1e3 * statistics.median(
                r["idle_exec_roundtrips"])
    base = table["unshare+overlay"]
    ratios = {name: {"p50_vs_unshare": t["p50_ms"] / base["p50_ms"],
                     "rate_vs_unshare": t["creates_per_s"] / base["creates_per_s"]}
              for name, t in table.items()}
    goals = {
        "p50_create_to_ready_le_10ms": table["edged"]["p50_ms"] <= 10,
        "p50_within_3x_unshare": ratios["edged"]["p50_vs_unshare"] <= 3,
        "creates_per_s_ge_100": table["edged"]["creates_per_s"] >= 100,
    }
    if args.json:
        print(json.dumps({"results": table, "ratios": ratios, "goals": goals,
                          "params": vars(args), "loadavg_1min": os.getloadavg()[0]}, indent=2))
        return 0
    print(f"create → first exec done, {'EROFS' if args.erofs else 'directory'} lower, "
          f"concurrency {args.concurrency} for creates/s")
    print(f"{'':18}{'p50 ms':>9}{'p99 ms':>9}{'creates/s':>11}{'p50 ×unshare':>14}")
    for name, t in table.items():
        print(f"{name:18}{t['p50_ms']:9.2f}{t['p99_ms']:9.2f}{t['creates_per_s']:11.1f}"
              f"{ratios[name]['p50_vs_unshare']:14.2f}")
    for name, t in table.items():
        if "exec_roundtrip_p50_ms" in t:
            print(f"{name}: exec `true` round trip p50 {t['exec_roundtrip_p50_ms']:.2f} ms; "
                  f"after {args.idle_ms:.0f} ms idle: create→first exec p50 "
                  f"{t['after_idle_p50_ms']:.2f} ms, exec round trip p50 "
                  f"{t['after_idle_exec_roundtrip_p50_ms']:.2f} ms")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    for k, v in goals.items():
        print(f"goal {k}: {'met' if v else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
