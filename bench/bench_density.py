"""Density: how many idle sandboxes this node holds with the daemon's default settings, what
each costs the host (kernel and user memory), what reclaim saves, what a wake costs, and how
the latency-sensitive CPU class fares under best-effort load.

    .venv/bin/python bench/bench_density.py [--n 3200] [--agent-n 1000]
        [--workloads sleep,python,agent] [--baseline-n 300] [--settle-s 300] [--json]

Needs root. The daemon runs as a process of its own with its default settings (only its
socket, state, runtime and layer store directories are its own); the layer is the Debian
rootfs (``scripts/rootfs.sh``, python3 included) built by layerfs. Workloads, each started
in the background by one exec per sandbox, which then ends (a sandbox with no exec running
is what the node may call idle):
- ``sleep``: ``sleep infinity``;
- ``python``: ``python3 -c "import json, asyncio, sqlite3, time; time.sleep(1e9)"`` (an agent's
  idle tool server);
- ``agent``: a Python process that builds ~50 MiB of heap once (records of random words,
  numbers and tags, like parsed tool outputs; seeded per sandbox, so no two are alike) and
  idles; its exec ends once the heap is built (so at most ``--conc`` build at once).
Phases:
1. **reclaim saving**: ``--baseline-n`` python sandboxes with reclaim off
   (``--reclaim false --pause-reclaim false``), then the same with the defaults, each settled:
   host memory per sandbox (MemAvailable drop / N), and the saving;
2. **waves** of each workload up to N (or the wall: the first create refused for
   ``--wall-s`` seconds, whose reason is reported); sampled as they grow: host MemAvailable,
   kernel memory per sandbox (Slab + KernelStack + PageTables + Percpu, over the count) and
   its marginal cost near the 100th and the Nth sandbox, create p50/p99; once settled
   (reclaim done or ``--settle-s``): zram stored vs compressed, idle CPU of the daemon and of
   the sandboxes over ``--idle-window-s``, wake (the first exec on reclaimed sandboxes,
   oldest first) p50/p99 against a second exec on the same ones, and the refault rate
   (major faults per minute since reclaim, over the working sets, from ``GET /v1/node``);
3. **QoS**: exec round trip in a latency-sensitive sandbox on an idle node and with
   best-effort sandboxes running two busy loops per core.
Every sandbox is deleted at the end of its phase (the node must come back to where it was).
On a machine shared with other work the host figures move with it: the load average is
printed; compare ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edged.client import (
    AsyncSandbox,
    CapacityExhaustedError,
    RetryPolicy,
    Sandbox,
    SandboxError,
)
from edged.client._http import Transport
from edged.config import Config
from edged.node import hostmem
from edged.node.admission import kernel_bytes

MiB = 1 << 20
GiB = 1 << 30
ROOTFS_TAR = Path("/var/cache/edged-test/debian-rootfs.tar")
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
AGENT = r"""
import json, asyncio, sqlite3, time, random, os
rnd = random.Random(int.from_bytes(os.urandom(8), "little"))
words = ["".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 10)))
         for _ in range(5000)]
state = []
n = 0
while n < 50 << 20:
    text = " ".join(rnd.choices(words, k=rnd.randint(5, 40)))
    state.append({"id": len(state), "score": rnd.random(), "n": rnd.getrandbits(30),
                  "text": text, "tags": rnd.choices(words, k=3)})
    n += len(text) + 400
# built: the exec that started it ends here, and the state idles in a child (its pages
# its own once the parent is gone)
if os.fork():
    os._exit(0)
os.setsid()
time.sleep(1e9)
"""
WORKLOADS = {
    "sleep": "sleep infinity",
    "python": "python3 -c 'import json, asyncio, sqlite3, time; time.sleep(1e9)'",
    "agent": "python3 /tmp/agent.py",
}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def host() -> tuple[int, int]:
    """(MemAvailable, kernel bytes) now."""
    mi = hostmem.meminfo()
    return mi["MemAvailable"], kernel_bytes(mi)


def build_layer(work: Path) -> tuple[str, str]:
    from layerfs.build import build_layer as build
    from layerfs.store import Store

    if not ROOTFS_TAR.exists():
        raise SystemExit(f"bench_density: {ROOTFS_TAR} missing: run scripts/rootfs.sh")
    store = str(work / "store")
    return store, build(str(ROOTFS_TAR), kind="base", store=Store(store)).digest


class Daemon:
    """``edged serve`` as a process of its own, default settings but its directories and
    ``extra`` flags."""

    def __init__(self, work: Path, store: str, tag: str, **extra: object) -> None:
        self.runtime = tempfile.mkdtemp(prefix=f"edged-bench-density-{tag}-", dir="/run")
        self.cfg = Config(socket=str(work / f"{tag}.sock"), state_dir=str(work / f"state-{tag}"),
                          runtime_dir=self.runtime, store_dir=store)
        argv = [sys.executable, "-c", "import sys; from edged.cli import main; sys.exit(main())",
                "serve", "--socket", self.cfg.socket, "--state-dir", self.cfg.state_dir,
                "--runtime-dir", self.runtime, "--store-dir", store, "--log-level", "warning"]
        for k, v in extra.items():
            argv += ["--" + k.replace("_", "-"), str(v).lower() if isinstance(v, bool) else str(v)]
        self.argv = argv
        self._start(argv)

    def _start(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, cwd=str(Path(__file__).resolve().parents[1]))
        deadline = time.monotonic() + 60
        while True:
            try:
                Sandbox.list(socket=self.cfg.socket)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError("the daemon did not start") from None
                time.sleep(0.1)

    def node(self) -> dict[str, Any]:
        info: dict[str, Any] = Transport(self.cfg.socket, timeout=120).json("GET", "/v1/node")
        return info

    def cpu_s(self) -> float:
        """CPU seconds the daemon process used so far."""
        f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def _term(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def left(self) -> bool:
        """Whether the stopped daemon left something: sandboxes its stop could not end in
        time (their cgroups, named by the state dir's hash, beneath this process's own in
        any v1 hierarchy), the zram device it kept for their pages (its record) or its
        layer mounts (in its state dir)."""
        state = str(Path(self.cfg.state_dir).resolve())
        if Path(state, "swap.json").exists():
            return True
        if any(f" {state}/" in ln for ln in Path("/proc/mounts").read_text().splitlines()):
            return True
        tag = "edged-" + hashlib.sha256(state.encode()).hexdigest()[:10]
        for ln in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrl, own = ln.split(":", 2)
            for d in (Path("/sys/fs/cgroup", ctrl, own.lstrip("/"), tag),
                      Path("/sys/fs/cgroup", ctrl, own.lstrip("/"), tag + "-idle")):
                with contextlib.suppress(OSError):
                    if ctrl and any(p.is_dir() for p in d.iterdir()):
                        return True
        return False

    def stop(self) -> None:
        """Stop the daemon and make sure nothing of it is left: on a host whose CPUs other
        work keeps busy, killed best-effort sandboxes can take longer to die than the stop
        waits, and the stop then keeps them (and the zram device holding their pages). A
        daemon started again on the same directories with ``on_start = destroy`` removes
        them, its stop the device; tried until nothing is left (or 10 times)."""
        self._term()
        for _ in range(10):
            if not self.left():
                break
            print("bench_density: the daemon left sandboxes or swap; cleaning up",
                  file=sys.stderr)
            time.sleep(5)
            self._start([*self.argv, "--on-start", "destroy"])
            self._term()
        shutil.rmtree(self.runtime, ignore_errors=True)


def sandboxes_cpu_s(info: dict[str, Any]) -> float:
    """CPU seconds every sandbox together used so far (their parent cgroup)."""
    parents = info.get("features", {}).get("cgroup_parents", {})
    for c, f, scale in (("cpuacct", "cpuacct.usage", 1e-9), ("v2", "cpu.stat", 1e-6)):
        if c in parents:
            text = Path(parents[c], f).read_text()
            if c == "v2":
                text = text.split("usage_usec ")[1].split()[0]
            return int(text.split()[0]) * scale
    return 0.0


@dataclasses.dataclass
class Wave:
    """What one workload's wave measured."""

    workload: str
    target: int
    created: int = 0
    create_s: list[float] = dataclasses.field(default_factory=list)
    samples: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # n, av, kern
    wall: str | None = None
    ids: list[str] = dataclasses.field(default_factory=list)
    failed: int = 0  # creates that failed (not refused): counted, the first one kept
    failure: str | None = None


async def fill(d: Daemon, digest: str, w: Wave, wall_s: float, conc: int = 8,
               setup: bool = False, fill_s: float = 0.0) -> None:
    """Create ``w.target`` sandboxes running ``w.workload`` (or stop at the wall, or after
    ``fill_s`` seconds if > 0: a wave the host's CPU load slows to a crawl ends with what
    it has, its wall saying so)."""
    t_end = time.monotonic() + fill_s if fill_s > 0 else float("inf")
    sock = d.cfg.socket
    cmd = WORKLOADS[w.workload]
    marks = {100, 200, w.target}
    marks |= set(range(400, w.target, 400)) | {max(1, w.target - 100)}
    lock = asyncio.Lock()
    stop = asyncio.Event()
    w.samples.append((0, *host()))

    async def one(i: int) -> None:
        sid = f"{w.workload}-{i}"
        refused_since: float | None = None
        while not stop.is_set():
            if time.monotonic() > t_end:
                w.wall = w.wall or f"time: --fill-s {fill_s:g} s passed"
                stop.set()
                return
            t0 = time.perf_counter()
            try:
                # its own loop sees each refusal (no SDK retry inside the create it times)
                s = await AsyncSandbox.create(layers=[digest], id=sid, env=ENV, socket=sock,
                                              timeout=0, retry=RetryPolicy(retries=0))
            except CapacityExhaustedError as e:
                now = time.monotonic()
                refused_since = refused_since or now
                if now - refused_since > wall_s:
                    w.wall = w.wall or str(e)
                    stop.set()
                    return
                await asyncio.sleep(max(0.2, getattr(e, "retry_after", 1.0) or 1.0))
                continue
            except SandboxError as e:  # a failed create is a result, not the end of the run
                w.failed += 1
                w.failure = w.failure or f"{type(e).__name__}: {e}"
                return
            dt = time.perf_counter() - t0
            try:
                if w.workload == "agent":
                    await s.files.write("/tmp/agent.py", AGENT)
                # the agent builds its state in the foreground (the exec ends once it is
                # built), the others start in the background
                bg = "" if w.workload == "agent" else " &"
                r = await s.exec(f"{cmd} > /dev/null 2>&1{bg}", timeout=900)
                if r.exit_code != 0:
                    raise SandboxError(f"{sid}: start: {r.reason} {r.exit_code} {r.stderr}")
            except SandboxError as e:
                w.failed += 1
                w.failure = w.failure or f"{type(e).__name__}: {e}"
                with contextlib.suppress(SandboxError):
                    await s.kill()
                return
            finally:
                await s.close()
            async with lock:
                w.create_s.append(dt)
                w.ids.append(sid)
                w.created += 1
                if w.created in marks:
                    w.samples.append((w.created, *host()))
            return

    pending = iter(range(w.target))
    async def worker() -> None:
        for i in pending:
            if stop.is_set():
                return
            await one(i)

    await asyncio.gather(*(worker() for _ in range(conc)))
    if not w.samples or w.samples[-1][0] != w.created:
        w.samples.append((w.created, *host()))


def settle(d: Daemon, n: int, settle_s: float, want_reclaimed: bool) -> dict[str, Any]:
    """Wait until reclaim has covered 95% of the ``n`` sandboxes (or ``settle_s``)."""
    deadline = time.monotonic() + settle_s
    info = d.node()
    while time.monotonic() < deadline:
        info = d.node()
        if want_reclaimed and info["reclaim"]["sandboxes_reclaimed"] >= 0.95 * n:
            time.sleep(5)  # the last of them
            return d.node()
        time.sleep(5)
    return info


async def wake(d: Daemon, ids: list[str], k: int) -> tuple[list[float], list[float]]:
    """First exec (a wake, if reclaimed) and a second one on the ``k`` oldest sandboxes."""
    first, second = [], []
    for sid in ids[:k]:
        s = await AsyncSandbox.connect(sid, socket=d.cfg.socket)
        try:
            for lst in (first, second):
                t0 = time.perf_counter()
                await s.exec(["true"])
                lst.append(time.perf_counter() - t0)
        finally:
            await s.close()
    return first, second


async def delete_all(d: Daemon, ids: list[str], conc: int = 16) -> None:
    it = iter(ids)

    async def worker() -> None:
        for sid in it:
            with contextlib.suppress(Exception):
                s = await AsyncSandbox.connect(sid, socket=d.cfg.socket)
                try:
                    await s.kill()
                finally:
                    await s.close()

    await asyncio.gather(*(worker() for _ in range(conc)))


def marginal(samples: list[tuple[int, int, int]], lo: int, hi: int) -> float | None:
    """Kernel bytes per sandbox between the samples nearest ``lo`` and ``hi`` sandboxes."""
    pts = {n: k for n, _a, k in samples}
    a = min(pts, key=lambda n: abs(n - lo))
    b = min(pts, key=lambda n: abs(n - hi))
    if b <= a:
        return None
    return (pts[b] - pts[a]) / (b - a)


def run_wave(d: Daemon, digest: str, workload: str, n: int, a: argparse.Namespace,
             reclaim: bool = True) -> dict[str, Any]:
    w = Wave(workload, n)
    t0 = time.monotonic()
    asyncio.run(fill(d, digest, w, a.wall_s, fill_s=a.fill_s))
    fill_s = time.monotonic() - t0
    info = settle(d, w.created, a.settle_s if reclaim else 20.0, reclaim)
    av0, k0 = w.samples[0][1], w.samples[0][2]
    av1, k1 = host()
    # idle CPU over a quiet window: nothing but idle sandboxes
    c0, s0, t0 = d.cpu_s(), sandboxes_cpu_s(info), time.monotonic()
    time.sleep(a.idle_window_s)
    dt = time.monotonic() - t0
    idle_daemon = (d.cpu_s() - c0) / dt
    idle_sbx = (sandboxes_cpu_s(info) - s0) / dt
    if reclaim and info["reclaim"]["sandboxes_reclaimed"]:
        # refaults are counted when reclaimed sandboxes are looked at again (every 60 s)
        time.sleep(max(0.0, a.refault_wait_s - a.idle_window_s))
    refault_info = d.node()
    first, second = asyncio.run(wake(d, w.ids, min(a.wake_k, w.created))) if reclaim else ([], [])
    after = d.node()
    n_ = max(1, w.created)
    out: dict[str, Any] = {
        "workload": workload, "target": n, "created": w.created, "wall": w.wall,
        "failed": w.failed, "failure": w.failure,
        "fill_s": fill_s,
        "create_p50_ms": pct(w.create_s, 50) * 1e3, "create_p99_ms": pct(w.create_s, 99) * 1e3,
        "mem_available_gib": av1 / GiB,
        "host_per_sandbox_mib": (av0 - av1) / n_ / MiB,
        "kernel_per_sandbox_mib": (k1 - k0) / n_ / MiB,
        "user_per_sandbox_mib": ((av0 - av1) - (k1 - k0)) / n_ / MiB,
        "kernel_marginal_100th_mib": (marginal(w.samples, 100, 200) or float("nan")) / MiB,
        "kernel_marginal_nth_mib": (marginal(w.samples, max(1, w.created - 100), w.created)
                                    or float("nan")) / MiB,
        "samples": w.samples,
        "reclaimed": info["reclaim"]["sandboxes_reclaimed"],
        "reclaimed_bytes": info["reclaim"]["reclaimed_bytes"],
        "swap": {k: v for k, v in (info.get("swap") or {}).items() if k.startswith(
            ("zram_", "used_", "total_"))},
        "idle_cpu_daemon_pct": idle_daemon * 100, "idle_cpu_sandboxes_pct": idle_sbx * 100,
        "wake_p50_ms": pct(first, 50) * 1e3, "wake_p99_ms": pct(first, 99) * 1e3,
        "awake_exec_p50_ms": pct(second, 50) * 1e3, "awake_exec_p99_ms": pct(second, 99) * 1e3,
        "wakes": after["reclaim"]["wakes"],
        "refault_pct_per_min": refault_info["reclaim"]["refault_pct_per_min"],
        "kernel_per_sandbox_node_mib": info["memory"]["kernel_per_sandbox_bytes"] / MiB,
    }
    asyncio.run(delete_all(d, w.ids))
    out["mem_available_after_delete_gib"] = host()[0] / GiB
    return out


async def qos(d: Daemon, digest: str, k: int) -> dict[str, Any]:
    sock = d.cfg.socket
    cores = len(os.sched_getaffinity(0))

    async def rt(s: AsyncSandbox) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            await s.exec(["true"])
            out.append(time.perf_counter() - t0)
        return out

    ls = await AsyncSandbox.create(layers=[digest], id="qos-ls", env=ENV, socket=sock,
                                   qos="latency_sensitive", timeout=0)
    be_probe = await AsyncSandbox.create(layers=[digest], id="qos-be", env=ENV, socket=sock,
                                         timeout=0)
    load = []
    try:
        idle = await rt(ls)
        idle_be = await rt(be_probe)
        for i in range(max(2, cores)):
            s = await AsyncSandbox.create(layers=[digest], id=f"qos-load-{i}", env=ENV,
                                          socket=sock, cpus=2.0, timeout=0)
            load.append(s)
            await s.exec("sh -c 'while :; do :; done & while :; do :; done &' > /dev/null 2>&1")
        await asyncio.sleep(2.0)
        busy = await rt(ls)
        busy_be = await rt(be_probe)
    finally:
        for s in [ls, be_probe, *load]:
            with contextlib.suppress(Exception):
                await s.kill()
            await s.close()
    return {
        "loops": 2 * len(load),
        "ls_idle_p50_ms": pct(idle, 50) * 1e3, "ls_idle_p99_ms": pct(idle, 99) * 1e3,
        "ls_loaded_p50_ms": pct(busy, 50) * 1e3, "ls_loaded_p99_ms": pct(busy, 99) * 1e3,
        "ls_ratio_p50": pct(busy, 50) / pct(idle, 50),
        "ls_ratio_p99": pct(busy, 99) / pct(idle, 99),
        "be_idle_p50_ms": pct(idle_be, 50) * 1e3, "be_loaded_p50_ms": pct(busy_be, 50) * 1e3,
        "be_ratio_p50": pct(busy_be, 50) / pct(idle_be, 50),
    }


def partial(what: str, figures: dict[str, Any]) -> None:
    """A phase's figures as one JSON line on stderr as soon as it is done (a run stopped
    later keeps them)."""
    print(json.dumps({"partial": what, **figures}, default=str), file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3200, help="sandboxes of sleep and python")
    ap.add_argument("--agent-n", type=int, default=1000, help="sandboxes of agent")
    ap.add_argument("--workloads", default="sleep,python,agent")
    ap.add_argument("--baseline-n", type=int, default=300,
                    help="python sandboxes of the reclaim-saving phase (0: skip it)")
    ap.add_argument("--settle-s", type=float, default=300.0,
                    help="longest wait for reclaim after a wave")
    ap.add_argument("--idle-window-s", type=float, default=30.0)
    ap.add_argument("--refault-wait-s", type=float, default=90.0,
                    help="idle time after reclaim before the refault rate is read")
    ap.add_argument("--wall-s", type=float, default=60.0,
                    help="a wave stops when creates are refused this long")
    ap.add_argument("--fill-s", type=float, default=0.0,
                    help="a wave stops creating after this many seconds (0: never)")
    ap.add_argument("--wake-k", type=int, default=200, help="sandboxes woken per wave")
    ap.add_argument("--qos-k", type=int, default=200, help="exec round trips per QoS case")
    ap.add_argument("--no-qos", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_density: needs root", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="edged-bench-density-"))
    out: dict[str, Any] = {"date": started, "command": " ".join(sys.argv),
                           "loadavg_start": load0, "waves": [], "kernel": os.uname().release}
    try:
        store, digest = build_layer(work)
        if a.baseline_n > 0:
            d = Daemon(work, store, "noreclaim", reclaim=False, pause_reclaim=False)
            try:
                off = run_wave(d, digest, "python", a.baseline_n, a, reclaim=False)
            finally:
                d.stop()
            d = Daemon(work, store, "base")
            try:
                on = run_wave(d, digest, "python", a.baseline_n, a)
            finally:
                d.stop()
            out["saving"] = {
                "n": a.baseline_n, "no_reclaim_host_mib": off["host_per_sandbox_mib"],
                "reclaim_host_mib": on["host_per_sandbox_mib"],
                "saving_pct": (1 - on["host_per_sandbox_mib"] / off["host_per_sandbox_mib"])
                * 100, "no_reclaim": off, "reclaim": on}
            partial("saving", out["saving"])
        d = Daemon(work, store, "main")
        try:
            out["features"] = d.node().get("features")
            for wl in [x for x in a.workloads.split(",") if x]:
                out["waves"].append(run_wave(d, digest, wl, a.agent_n if wl == "agent"
                                             else a.n, a))
                partial("wave", out["waves"][-1])
            if not a.no_qos:
                out["qos"] = asyncio.run(qos(d, digest, a.qos_k))
                partial("qos", out["qos"])
        finally:
            d.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["loadavg_end"] = os.getloadavg()
    if a.json:
        print(json.dumps(out, indent=1, default=str))
        return 0
    report(out)
    return 0


def report(out: dict[str, Any]) -> None:
    print(f"bench_density  {out['date']}  kernel {out['kernel']}  load average "
          f"{out['loadavg_start'][0]:.2f} at start, {out['loadavg_end'][0]:.2f} at end")
    print(f"command: {out['command']}")
    if "saving" in out:
        s = out["saving"]
        print(f"\nreclaim saving, {s['n']} python sandboxes: {s['no_reclaim_host_mib']:.2f} MiB "
              f"each without reclaim, {s['reclaim_host_mib']:.2f} MiB with the defaults: "
              f"{s['saving_pct']:.1f}% less (goal >= 30%)")
    rows = [
        ("sandboxes created / asked", lambda w: f"{w['created']}/{w['target']}"),
        ("creates failed", lambda w: f"{w.get('failed', 0)}"),
        ("MemAvailable left, GiB (goal >= 4)", lambda w: f"{w['mem_available_gib']:.2f}"),
        ("host per sandbox, MiB", lambda w: f"{w['host_per_sandbox_mib']:.2f}"),
        ("  kernel per sandbox, MiB (goal <= 1)", lambda w: f"{w['kernel_per_sandbox_mib']:.2f}"),
        ("  user per sandbox, MiB", lambda w: f"{w['user_per_sandbox_mib']:.2f}"),
        ("kernel marginal ~100th, MiB", lambda w: f"{w['kernel_marginal_100th_mib']:.2f}"),
        ("kernel marginal Nth, MiB", lambda w: f"{w['kernel_marginal_nth_mib']:.2f}"),
        ("  Nth / 100th (goal <= 1.2)", lambda w: (
            f"{w['kernel_marginal_nth_mib'] / w['kernel_marginal_100th_mib']:.2f}")),
        ("create p50 / p99, ms", lambda w: f"{w['create_p50_ms']:.1f} / {w['create_p99_ms']:.1f}"),
        ("reclaimed sandboxes", lambda w: f"{w['reclaimed']}"),
        ("zram stored / compressed, MiB", lambda w: (
            f"{w['swap'].get('zram_orig_bytes', 0) / MiB:.0f} / "
            f"{w['swap'].get('zram_mem_used_bytes', 0) / MiB:.0f}")),
        ("wake p50 / p99, ms (goal p99 <= 50)",
         lambda w: f"{w['wake_p50_ms']:.1f} / {w['wake_p99_ms']:.1f}"),
        ("awake exec p50 / p99, ms",
         lambda w: f"{w['awake_exec_p50_ms']:.1f} / {w['awake_exec_p99_ms']:.1f}"),
        ("refault %/min of WS (goal <= 0.2)", lambda w: (
            "n/a" if w["refault_pct_per_min"] is None else f"{w['refault_pct_per_min']:.3f}")),
        ("idle CPU daemon, % core (goal <= 2)", lambda w: f"{w['idle_cpu_daemon_pct']:.2f}"),
        ("idle CPU sandboxes, % core", lambda w: f"{w['idle_cpu_sandboxes_pct']:.2f}"),
        ("wall", lambda w: w["wall"] or "-"),
    ]
    waves = out["waves"]
    if waves:
        print()
        print(f"{'':<40}" + "".join(f"{w['workload']:>16}" for w in waves))
        for name, f in rows:
            cells = []
            for w in waves:
                try:
                    cells.append(f(w))
                except (KeyError, ZeroDivisionError, TypeError):
                    cells.append("n/a")
            if name == "wall":
                for w, c in zip(waves, cells, strict=True):
                    if c != "-":
                        print(f"wall of {w['workload']}: {c}")
                    if w.get("failure"):
                        print(f"first failed create of {w['workload']}: {w['failure']}")
                continue
            print(f"{name:<40}" + "".join(f"{c:>16}" for c in cells))
    if "qos" in out:
        q = out["qos"]
        print(f"\nQoS, {q['loops']} best-effort busy loops: latency-sensitive exec round trip "
              f"p50 {q['ls_idle_p50_ms']:.2f} -> {q['ls_loaded_p50_ms']:.2f} ms "
              f"({q['ls_ratio_p50']:.2f}x; p99 {q['ls_ratio_p99']:.2f}x; goal <= 1.2x); "
              f"best-effort p50 {q['be_idle_p50_ms']:.2f} -> {q['be_loaded_p50_ms']:.2f} ms "
              f"({q['be_ratio_p50']:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
