"""Density: how many idle sandboxes this node holds with the daemon's default settings, what
each costs the host (kernel and user memory), what reclaim saves, what a wake costs, and how
the latency-sensitive CPU class fares under best-effort load.

    .venv/bin/python bench/bench_density.py [--n 3200] [--agent-n 1000]
        [--workloads sleep,python,agent] [--baseline-n 300] [--settle-s 300]
        [--budget-min 0] [--out FILE.jsonl] [--json]

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
   ``--wall-s`` seconds, whose reason is reported; a refused create is retried after its
   Retry-After, as a trainer would, and one admitted within ``--wall-s`` is *paced*, not
   walled: counted, with its wait); sampled as they grow: host MemAvailable,
   kernel memory per sandbox (Slab + KernelStack + PageTables + Percpu, over the count) and
   its marginal cost near the 100th and the Nth sandbox, and over 200 sandboxes near the
   100th (100 -> 300) and the Nth (N-200 -> N) by meminfo field and by slab cache
   (``/proc/slabinfo``), with the part charged to the sandboxes' memory cgroup
   (``memory.kmem.usage_in_bytes``), create p50/p99; once settled
   (reclaim done or ``--settle-s``): zram stored vs compressed, idle CPU of the daemon and of
   the sandboxes over ``--idle-window-s``, wake (the first exec on reclaimed sandboxes,
   oldest first) p50/p99 against a second exec on the same ones, and the refault rate
   (major faults per minute since reclaim, over the working sets, from ``GET /v1/node``);
3. **QoS**: exec round trip in a latency-sensitive sandbox on an idle node and with
   best-effort sandboxes running two busy loops per core.
Every sandbox is deleted at the end of its phase (the node must come back to where it was).
Time: the run keeps to ``--budget-min`` (0: enough for every wave's target, ~65 minutes
with the defaults, see :class:`Budget`): ``--tail-s`` (240 s) is set aside for each phase's
settle, measuring and deletes, and each wave's creating gets a share of the rest in
proportion to its estimated creating time (:data:`CREATE_S` per sandbox); a wave cut short
says so as its wall. Every phase's figures
(and samples as a wave grows) are appended to ``--out`` as JSON lines as soon as they are
measured, the whole run last; a failed phase is a figure (its ``error``) and the run goes on;
SIGINT or SIGTERM ends the run with everything deleted and the table of what was measured.
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


KERNEL_FIELDS = ("SUnreclaim", "SReclaimable", "KernelStack", "PageTables", "Percpu")


def slabs() -> dict[str, int]:
    """Bytes held by each slab cache now (``/proc/slabinfo``: num_objs x objsize)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for ln in Path("/proc/slabinfo").read_text().splitlines()[2:]:
            f = ln.split()
            out[f[0]] = int(f[2]) * int(f[3])
    return out


@dataclasses.dataclass
class Snap:
    """The host's kernel memory at ``n`` sandboxes: meminfo's kernel fields, every slab
    cache, and what the sandboxes' parent memory cgroup has charged as kernel memory."""

    n: int
    meminfo: dict[str, int]
    slabs: dict[str, int]
    kmem_charged: int | None

    @classmethod
    def take(cls, n: int, memory_parent: str | None) -> Snap:
        mi = hostmem.meminfo()
        charged = None
        if memory_parent:
            with contextlib.suppress(OSError, ValueError):
                charged = int(Path(memory_parent, "memory.kmem.usage_in_bytes").read_text())
        return cls(n, {k: mi.get(k, 0) for k in KERNEL_FIELDS}, slabs(), charged)


def per_sandbox(a: Snap, b: Snap, top: int = 12) -> dict[str, Any]:
    """Kernel bytes per sandbox between two snapshots, by meminfo field and by slab cache
    (the ``top`` caches that grew most), and the part charged to the sandboxes' cgroup."""
    n = b.n - a.n
    if n <= 0:
        return {}
    caches = {k: (b.slabs.get(k, 0) - a.slabs.get(k, 0)) / n for k in b.slabs}
    grown = sorted(caches.items(), key=lambda kv: -kv[1])[:top]
    out: dict[str, Any] = {
        "from_n": a.n, "to_n": b.n,
        "meminfo": {k: (b.meminfo[k] - a.meminfo[k]) / n for k in KERNEL_FIELDS},
        "total": sum(b.meminfo[k] - a.meminfo[k] for k in KERNEL_FIELDS) / n,
        "slabs": {k: v for k, v in grown if v > 0},
    }
    if a.kmem_charged is not None and b.kmem_charged is not None:
        out["charged_to_sandboxes"] = (b.kmem_charged - a.kmem_charged) / n
    return out


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

    def memory_parent(self) -> str | None:
        """The sandboxes' parent memory cgroup (v1 ``memory`` or v2), if any."""
        parents = self.node().get("features", {}).get("cgroup_parents", {})
        p = parents.get("memory") or parents.get("v2")
        return str(p) if p else None

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
    snaps: list[Snap] = dataclasses.field(default_factory=list)  # at 100, 300, N-200, N
    #: refusal spells that cleared (seconds from a create's first refusal to its admission):
    #: pacing, as a trainer retrying after Retry-After sees it; one lasting ``wall_s`` is
    #: the wall instead
    paced_s: list[float] = dataclasses.field(default_factory=list)
    refusals: int = 0
    refusal_reasons: dict[str, int] = dataclasses.field(default_factory=dict)


async def fill(d: Daemon, digest: str, w: Wave, wall_s: float, conc: int = 8,
               fill_s: float = 0.0, log: Log | None = None) -> None:
    """Create ``w.target`` sandboxes running ``w.workload`` (or stop at the wall, or after
    ``fill_s`` seconds if > 0: a wave the host's CPU load slows to a crawl ends with what
    it has, its wall saying so). Samples (and ``log`` lines) at marks as it grows; kernel
    snapshots at 100, 300, N-200 and N."""
    t_end = time.monotonic() + fill_s if fill_s > 0 else float("inf")
    sock = d.cfg.socket
    cmd = WORKLOADS[w.workload]
    snap_at = {100, 300, w.target - 200, w.target}
    marks = {100, 200, w.target} | snap_at
    marks |= set(range(400, w.target, 400)) | {max(1, w.target - 100)}
    memory_parent = d.memory_parent()
    lock = asyncio.Lock()
    stop = asyncio.Event()
    w.samples.append((0, *host()))
    t_start = time.monotonic()

    async def one(i: int) -> None:
        sid = f"{w.workload}-{i}"
        refused_since: float | None = None
        while not stop.is_set():
            if time.monotonic() > t_end:
                w.wall = w.wall or (f"time: this wave's share of the time budget "
                                    f"({fill_s:.0f} s) passed")
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
                w.refusals += 1
                kind = str(e).split(":")[1].strip() if str(e).count(":") >= 1 else str(e)
                w.refusal_reasons[kind] = w.refusal_reasons.get(kind, 0) + 1
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
            if refused_since is not None:
                w.paced_s.append(time.monotonic() - refused_since)
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
                    if w.created in snap_at:
                        w.snaps.append(Snap.take(w.created, memory_parent))
                    if log:
                        log.write("sample", {
                            "workload": w.workload, "n": w.created,
                            "mem_available": w.samples[-1][1], "kernel": w.samples[-1][2],
                            "elapsed_s": time.monotonic() - t_start, "failed": w.failed,
                            "refusals": w.refusals, "paced": len(w.paced_s),
                            "paced_longest_s": max(w.paced_s, default=0.0),
                            "create_p50_ms": pct(w.create_s, 50) * 1e3,
                            "create_p99_ms": pct(w.create_s, 99) * 1e3})
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
    if not w.snaps or w.snaps[-1].n != w.created:
        w.snaps.append(Snap.take(w.created, memory_parent))


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
    first: list[float] = []
    second: list[float] = []
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


def kernel_by_cache(snaps: list[Snap]) -> dict[str, Any]:
    """Kernel bytes per sandbox over 200 sandboxes near the 100th (100 -> 300) and near the
    Nth (N-200 -> N), by meminfo field and slab cache, and their ratio (goal <= 1.2). With
    fewer snapshots (a small or walled wave): the first two and the last two."""
    snaps = sorted({s.n: s for s in snaps}.values(), key=lambda s: s.n)
    if len(snaps) < 2:
        return {}
    by_n = {s.n: s for s in snaps}
    lo = (by_n[100], by_n[300]) if 100 in by_n and 300 in by_n else (snaps[0], snaps[1])
    top = snaps[-1]
    below = [s for s in snaps if s.n <= top.n - 200]
    hi = (below[-1] if below else snaps[-2], top)
    out: dict[str, Any] = {"near_100th": per_sandbox(*lo), "near_nth": per_sandbox(*hi)}
    a, b = out["near_100th"].get("total"), out["near_nth"].get("total")
    out["nth_over_100th"] = b / a if a and b is not None and a > 0 else None
    return out


#: wall seconds a create takes on this 2-core node, per workload, start-up included (quiet
#: runs of 2026-12-01: ``sleep`` 3,200 in 53 s; ``python`` 2,225 in 383 s; ``agent`` 400 in
#: 182 s while memory was free, and each agent builds its heap with ~1 s of CPU, so 1,000
#: need at least 500 s of both cores): what a wave's share of the time budget is sized by
CREATE_S = {"sleep": 0.03, "python": 0.2, "agent": 0.8}
#: the fill of a default budget is this many times the estimate (a loaded host, reclaim's
#: CPU beside the creates)
BUDGET_SLACK = 1.5


def phase_cost(phase: str, n: int) -> float:
    """Estimated seconds of creating in ``phase`` (``n`` sandboxes; the saving phases are
    ``python`` waves; ``qos`` creates a handful)."""
    workload = "python" if phase in ("noreclaim", "reclaim") else phase
    return n * CREATE_S.get(workload, 0.0)


class Budget:
    """The run's time budget: each phase's fill gets a share of what is left once the
    measuring of every phase still to come (``tail_s`` each) is set aside, in proportion to
    its estimated creating time (:func:`phase_cost`: an agent sandbox takes ~1 s of CPU to
    build its heap, a ``sleep`` one almost none); what a phase does not use goes to the next
    ones. ``minutes`` 0: enough for every wave to reach its target at ``BUDGET_SLACK`` ×
    its estimate (:meth:`default_minutes`)."""

    def __init__(self, minutes: float, tail_s: float, phases: dict[str, int]) -> None:
        self.minutes = minutes or self.default_minutes(tail_s, phases)
        self.deadline = time.monotonic() + self.minutes * 60
        self.tail_s = tail_s
        self.cost = {p: phase_cost(p, n) for p, n in phases.items()}
        self.left = list(phases)

    @staticmethod
    def default_minutes(tail_s: float, phases: dict[str, int]) -> float:
        """Minutes for ``phases`` (phase -> sandboxes): their fills at ``BUDGET_SLACK`` × the
        estimate, and ``tail_s`` for each phase's settle, measuring and deletes."""
        return (BUDGET_SLACK * sum(phase_cost(p, n) for p, n in phases.items())
                + tail_s * len(phases)) / 60

    def fill_s(self, phase: str, cap: float) -> float:
        """Seconds the fill of ``phase`` may take (at least 30; ``cap`` > 0 bounds it)."""
        rest = self.deadline - time.monotonic() - self.tail_s * len(self.left)
        weights = sum(self.cost.get(p, 0.0) for p in self.left)
        part = self.cost.get(phase, 0.0) / weights if weights > 0 else 1.0
        share = max(30.0, rest * part)
        return min(share, cap) if cap > 0 else share

    def settle_s(self, cap: float) -> float:
        """Seconds a settle may wait: ``cap``, less if the phases to come need the time."""
        rest = self.deadline - time.monotonic() - self.tail_s * max(0, len(self.left) - 1)
        return max(30.0, min(cap, rest))

    def done(self, phase: str) -> None:
        with contextlib.suppress(ValueError):
            self.left.remove(phase)


def run_wave(d: Daemon, digest: str, workload: str, n: int, a: argparse.Namespace,
             budget: Budget, phase: str, into: list[dict[str, Any]], reclaim: bool = True,
             log: Log | None = None) -> dict[str, Any]:
    """One workload's wave: fill, settle, measure, delete; its figures are appended to
    ``into`` at once (a stop keeps what was measured). Every step's failure is a figure
    (``error``) and what was measured before it is kept; the sandboxes are deleted
    whatever happened."""
    w = Wave(workload, n)
    t0 = time.monotonic()
    out: dict[str, Any] = {"workload": workload, "target": n}
    into.append(out)
    try:
        try:
            asyncio.run(fill(d, digest, w, a.wall_s, fill_s=budget.fill_s(phase, a.fill_s),
                             log=log))
        finally:
            fill_s = time.monotonic() - t0
            n_ = max(1, w.created)
            av0, k0 = w.samples[0][1:] if w.samples else host()
            out.update({
                "created": w.created, "wall": w.wall, "failed": w.failed,
                "failure": w.failure, "fill_s": fill_s,
                "create_p50_ms": pct(w.create_s, 50) * 1e3,
                "create_p99_ms": pct(w.create_s, 99) * 1e3,
                "refusals": w.refusals, "refusal_reasons": w.refusal_reasons,
                "paced": len(w.paced_s), "paced_s_total": sum(w.paced_s),
                "paced_longest_s": max(w.paced_s, default=0.0),
                "paced_p50_s": pct(w.paced_s, 50) if w.paced_s else 0.0,
                "samples": w.samples,
                "kernel_marginal_100th_mib": (marginal(w.samples, 100, 200)
                                              or float("nan")) / MiB,
                "kernel_marginal_nth_mib": (marginal(w.samples, max(1, w.created - 100),
                                                     w.created) or float("nan")) / MiB,
                "kernel_by_cache": kernel_by_cache(w.snaps),
            })
        if log:
            log.write("filled", {k: v for k, v in out.items() if k != "samples"})
        info = settle(d, w.created, budget.settle_s(a.settle_s) if reclaim else 20.0, reclaim)
        av1, k1 = host()
        out.update({
            "settle_s": time.monotonic() - t0 - fill_s,
            "mem_available_gib": av1 / GiB,
            "host_per_sandbox_mib": (av0 - av1) / n_ / MiB,
            "kernel_per_sandbox_mib": (k1 - k0) / n_ / MiB,
            "user_per_sandbox_mib": ((av0 - av1) - (k1 - k0)) / n_ / MiB,
            "reclaimed": info["reclaim"]["sandboxes_reclaimed"],
            "reclaimed_bytes": info["reclaim"]["reclaimed_bytes"],
            "swap": {k: v for k, v in (info.get("swap") or {}).items() if k.startswith(
                ("zram_", "used_", "total_", "room_", "ratio"))},
            "swap_full_sandboxes": info["reclaim"].get("swap_full_sandboxes", 0),
            "kernel_per_sandbox_node_mib": info["memory"]["kernel_per_sandbox_bytes"] / MiB,
        })
        # idle CPU over a quiet window: nothing but idle sandboxes
        c0, s0, t1 = d.cpu_s(), sandboxes_cpu_s(info), time.monotonic()
        time.sleep(a.idle_window_s)
        dt = time.monotonic() - t1
        out["idle_cpu_daemon_pct"] = (d.cpu_s() - c0) / dt * 100
        out["idle_cpu_sandboxes_pct"] = (sandboxes_cpu_s(info) - s0) / dt * 100
        # and minute by minute after it, as the reclaimer's rechecks of reclaimed sandboxes
        # back off (60 s, then twice as long each time, up to 10 minutes)
        by_min: list[float] = []
        for _ in range(int(a.idle_watch_min)):
            c0, t1 = d.cpu_s(), time.monotonic()
            time.sleep(60.0)
            by_min.append((d.cpu_s() - c0) / (time.monotonic() - t1) * 100)
        if by_min:
            out["idle_cpu_daemon_by_min_pct"] = by_min
        if reclaim and info["reclaim"]["sandboxes_reclaimed"]:
            # refaults are counted when reclaimed sandboxes are looked at again (every 60 s)
            time.sleep(max(0.0, a.refault_wait_s - a.idle_window_s))
        out["refault_pct_per_min"] = d.node()["reclaim"]["refault_pct_per_min"]
        if reclaim:
            first, second = asyncio.run(wake(d, w.ids, min(a.wake_k, w.created)))
            out.update({
                "wake_p50_ms": pct(first, 50) * 1e3, "wake_p99_ms": pct(first, 99) * 1e3,
                "awake_exec_p50_ms": pct(second, 50) * 1e3,
                "awake_exec_p99_ms": pct(second, 99) * 1e3,
                "wakes": d.node()["reclaim"]["wakes"]})
    except Exception as e:  # the figures so far are kept; the error is one of them
        out["error"] = f"{type(e).__name__}: {e}"
    except KeyboardInterrupt:
        out["error"] = "stopped"
        raise
    finally:
        budget.done(phase)
        t2 = time.monotonic()
        try:
            asyncio.run(delete_all(d, w.ids))
        finally:
            out["delete_s"] = time.monotonic() - t2
            out["mem_available_after_delete_gib"] = host()[0] / GiB
            out["phase_s"] = time.monotonic() - t0
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


class Log:
    """Each phase's figures as one JSON line, as soon as they are measured, appended to a
    file (flushed and synced: a stop, a crash or a host OOM later keeps them) and on
    stderr."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f = open(path, "a")  # noqa: SIM115 - open for the whole run

    def write(self, what: str, figures: dict[str, Any]) -> None:
        line = json.dumps({"phase": what, "time": time.strftime("%H:%M:%S"),
                           "loadavg": os.getloadavg(), **figures}, default=str)
        print(line, file=sys.stderr, flush=True)
        self.f.write(line + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def _sigterm(_signo: int, _frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


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
    ap.add_argument("--idle-watch-min", type=float, default=0.0,
                    help="after the idle window, the daemon's idle CPU minute by minute for "
                         "this many minutes (the steady state of the reclaimer's rechecks)")
    ap.add_argument("--refault-wait-s", type=float, default=90.0,
                    help="idle time after reclaim before the refault rate is read")
    ap.add_argument("--wall-s", type=float, default=60.0,
                    help="a wave stops when creates are refused this long")
    ap.add_argument("--fill-s", type=float, default=0.0,
                    help="a wave stops creating after this many seconds at most (0: its "
                         "share of the time budget)")
    ap.add_argument("--budget-min", type=float, default=0.0,
                    help="the whole run's time budget: each wave's creating ends at its share "
                         "(the wall then says so); 0: enough for every wave's target "
                         "(Budget.default_minutes: ~65 for the defaults, ~28 for 1,000 "
                         "agents alone)")
    ap.add_argument("--tail-s", type=float, default=240.0,
                    help="time set aside for each phase's settle, measuring and deletes")
    ap.add_argument("--wake-k", type=int, default=200, help="sandboxes woken per wave")
    ap.add_argument("--qos-k", type=int, default=200, help="exec round trips per QoS case")
    ap.add_argument("--no-qos", action="store_true")
    ap.add_argument("--daemon-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the waves' daemon off its default (e.g. "
                         "memory_reserve_bytes=12884901888: a shortage at moderate scale); "
                         "repeatable. The figures are then not of the defaults")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON lines of every phase as it ends (default: "
                         "/var/tmp/bench_density-<date>.jsonl)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_density: needs root", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.monotonic()
    log = Log(a.out or Path(f"/var/tmp/bench_density-{time.strftime('%Y%m%dT%H%M%S')}.jsonl"))
    print(f"bench_density: phases go to {log.path} as they end", file=sys.stderr)
    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="edged-bench-density-"))
    out: dict[str, Any] = {"date": started, "command": " ".join(sys.argv),
                           "loadavg_start": load0, "waves": [], "kernel": os.uname().release,
                           "log": str(log.path)}
    log.write("start", {k: v for k, v in out.items() if k != "waves"})

    def daemon(tag: str, **extra: object) -> Daemon:
        t = time.monotonic()
        d = Daemon(work, store, tag, **extra)
        out.setdefault("daemon_start_s", {})[tag] = time.monotonic() - t
        return d

    workloads = [x for x in a.workloads.split(",") if x]
    phases = {**({"noreclaim": a.baseline_n, "reclaim": a.baseline_n} if a.baseline_n > 0
                 else {}),
              **{wl: a.agent_n if wl == "agent" else a.n for wl in workloads},
              **({} if a.no_qos else {"qos": 0})}
    budget = Budget(a.budget_min, a.tail_s, phases)
    out["budget_min"] = budget.minutes
    try:
        store, digest = build_layer(work)
        if a.baseline_n > 0:
            saving: dict[str, Any] = {"n": a.baseline_n}
            out["saving"] = saving
            runs: list[dict[str, Any]] = []
            d = daemon("noreclaim", reclaim=False, pause_reclaim=False)
            try:
                saving["no_reclaim"] = off = run_wave(d, digest, "python", a.baseline_n, a,
                                                      budget, "noreclaim", runs, reclaim=False,
                                                      log=log)
            finally:
                d.stop()
            log.write("no_reclaim", off)
            d = daemon("base")
            try:
                saving["reclaim"] = on = run_wave(d, digest, "python", a.baseline_n, a, budget,
                                                  "reclaim", runs, log=log)
            finally:
                d.stop()
            log.write("reclaim", on)
            with contextlib.suppress(KeyError, ZeroDivisionError):
                saving.update({
                    "no_reclaim_host_mib": off["host_per_sandbox_mib"],
                    "reclaim_host_mib": on["host_per_sandbox_mib"],
                    "saving_pct": (1 - on["host_per_sandbox_mib"] / off["host_per_sandbox_mib"])
                    * 100})
            out["saving"] = saving
            log.write("saving", {k: v for k, v in saving.items()
                                 if k not in ("no_reclaim", "reclaim")})
        d = daemon("main", **dict(o.split("=", 1) for o in a.daemon_opt))
        try:
            out["features"] = d.node().get("features")
            for wl in workloads:
                run_wave(d, digest, wl, a.agent_n if wl == "agent" else a.n, a, budget, wl,
                         out["waves"], log=log)
                log.write("wave", out["waves"][-1])
            if not a.no_qos:
                try:
                    out["qos"] = asyncio.run(qos(d, digest, a.qos_k))
                except Exception as e:
                    out["qos"] = {"error": f"{type(e).__name__}: {e}"}
                log.write("qos", out["qos"])
                budget.done("qos")
        finally:
            d.stop()
    except KeyboardInterrupt as e:  # the figures so far are printed, everything cleaned up
        out["stopped"] = str(e) or "interrupted"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["loadavg_end"] = os.getloadavg()
    out["duration_s"] = time.monotonic() - t_start
    log.write("end", {k: out.get(k) for k in ("loadavg_end", "duration_s", "stopped", "error")})
    log.write("result", out)  # the whole run, as --json prints it
    if a.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        report(out)
    return 1 if "error" in out or "stopped" in out else 0


def report(out: dict[str, Any]) -> None:
    print(f"bench_density  {out['date']}  kernel {out['kernel']}  load average "
          f"{out['loadavg_start'][0]:.2f} at start, {out['loadavg_end'][0]:.2f} at end")
    print(f"command: {out['command']}")
    print(f"took {out['duration_s'] / 60:.1f} min; phases as JSON lines in {out['log']}")
    for k in ("stopped", "error"):
        if k in out:
            print(f"run {k}: {out[k]}")
    if "saving" in out:
        s = out["saving"]
        if "saving_pct" in s:
            print(f"\nreclaim saving, {s['n']} python sandboxes: {s['no_reclaim_host_mib']:.2f} "
                  f"MiB each without reclaim, {s['reclaim_host_mib']:.2f} MiB with the "
                  f"defaults: {s['saving_pct']:.1f}% less (goal >= 30%)")
        for k in ("no_reclaim", "reclaim"):
            if s.get(k, {}).get("error"):
                print(f"reclaim saving, {k}: {s[k]['error']}")
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
        ("kernel/sbx 100->300, MiB", lambda w: (
            f"{w['kernel_by_cache']['near_100th']['total'] / MiB:.2f}")),
        ("kernel/sbx N-200->N, MiB", lambda w: (
            f"{w['kernel_by_cache']['near_nth']['total'] / MiB:.2f}")),
        ("  ratio (goal <= 1.2)", lambda w: f"{w['kernel_by_cache']['nth_over_100th']:.2f}"),
        ("  charged to sandboxes N-200->N, MiB", lambda w: (
            f"{w['kernel_by_cache']['near_nth']['charged_to_sandboxes'] / MiB:.2f}")),
        ("create p50 / p99, ms", lambda w: f"{w['create_p50_ms']:.1f} / {w['create_p99_ms']:.1f}"),
        ("paced creates / longest wait, s", lambda w: (
            f"{w['paced']} / {w['paced_longest_s']:.1f}")),
        ("  refusals (all retries)", lambda w: f"{w['refusals']}"),
        ("fill / settle / delete, s", lambda w: (
            f"{w['fill_s']:.0f}/{w.get('settle_s', 0):.0f}/{w['delete_s']:.0f}")),
        ("reclaimed sandboxes", lambda w: f"{w['reclaimed']}"),
        ("zram stored / compressed, MiB", lambda w: (
            f"{w['swap'].get('zram_orig_bytes', 0) / MiB:.0f} / "
            f"{w['swap'].get('zram_mem_used_bytes', 0) / MiB:.0f}")),
        ("zram RAM limit MiB / full / swap room MiB", lambda w: (
            f"{w['swap'].get('zram_mem_limit_bytes', 0) / MiB:.0f} / "
            f"{'yes' if w['swap'].get('zram_full') else 'no'} / "
            f"{w['swap'].get('room_bytes', 0) / MiB:.0f}")),
        ("wake p50 / p99, ms (goal p99 <= 50)",
         lambda w: f"{w['wake_p50_ms']:.1f} / {w['wake_p99_ms']:.1f}"),
        ("awake exec p50 / p99, ms",
         lambda w: f"{w['awake_exec_p50_ms']:.1f} / {w['awake_exec_p99_ms']:.1f}"),
        ("refault %/min of WS (goal <= 0.2)", lambda w: (
            "n/a" if w["refault_pct_per_min"] is None else f"{w['refault_pct_per_min']:.3f}")),
        ("idle CPU daemon, % core (goal <= 2)", lambda w: f"{w['idle_cpu_daemon_pct']:.2f}"),
        ("idle CPU sandboxes, % core", lambda w: f"{w['idle_cpu_sandboxes_pct']:.2f}"),
        ("idle CPU daemon by minute after, %", lambda w: " ".join(
            f"{x:.2f}" for x in w.get("idle_cpu_daemon_by_min_pct", [])) or "-"),
        ("wall", lambda w: w["wall"] or "-"),
    ]
    waves = out["waves"]
    if waves:
        print()
        print(f"{'':<40}" + "".join(f"{w['workload']:>20}" for w in waves))
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
                    if w.get("paced"):
                        print(f"paced, not walled, {w['workload']}: {w['paced']} creates "
                              f"refused then admitted, waiting {w['paced_s_total']:.0f} s in "
                              f"all (p50 {w['paced_p50_s']:.1f} s, longest "
                              f"{w['paced_longest_s']:.1f} s < --wall-s); refusals by "
                              f"reason: {w.get('refusal_reasons')}")
                    if w.get("failure"):
                        print(f"first failed create of {w['workload']}: {w['failure']}")
                    if w.get("error"):
                        print(f"wave {w['workload']} ended early: {w['error']}")
                continue
            print(f"{name:<40}" + "".join(f"{c:>20}" for c in cells))
        for w in waves:
            kc = w.get("kernel_by_cache") or {}
            shown = set()
            for part in ("near_100th", "near_nth"):
                kp: dict[str, Any] | None = kc.get(part)
                if not kp or (kp["from_n"], kp["to_n"]) in shown:
                    continue
                shown.add((kp["from_n"], kp["to_n"]))
                fields = ", ".join(f"{f} {v / 1024:.0f}" for f, v in kp["meminfo"].items())
                caches = ", ".join(f"{c} {v / 1024:.1f}" for c, v in kp["slabs"].items())
                print(f"{w['workload']} kernel KiB/sandbox {kp['from_n']}->{kp['to_n']}: {fields}; "
                      f"slab caches: {caches}")
    if "qos" in out and "error" in out["qos"]:
        print(f"\nQoS: {out['qos']['error']}")
    elif "qos" in out:
        q = out["qos"]
        print(f"\nQoS, {q['loops']} best-effort busy loops: latency-sensitive exec round trip "
              f"p50 {q['ls_idle_p50_ms']:.2f} -> {q['ls_loaded_p50_ms']:.2f} ms "
              f"({q['ls_ratio_p50']:.2f}x; p99 {q['ls_ratio_p99']:.2f}x; goal <= 1.2x); "
              f"best-effort p50 {q['be_idle_p50_ms']:.2f} -> {q['be_loaded_p50_ms']:.2f} ms "
              f"({q['be_ratio_p50']:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
