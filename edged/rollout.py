"""``edged rollout``: the main job, end to end on one node.

1. Layers (layerfs, deterministic, deduplicated in the store): **base** from a Debian rootfs
   tarball (``mmdebstrap --variant=minbase --include=python3``, made if missing);
   **workspace** from a real project's source release fetched from PyPI as an sdist (its test
   suite included) at ``/work/<project>``; **toolkit** with pytest and the project's test
   dependencies installed from PyPI into ``/opt/toolkit`` (``PYTHONPATH``).
2. A daemon (:class:`edged.daemon.Server`, real container backend) on a private socket; the
   image ``rollout/<project>:latest`` registered.
3. N sandboxes in parallel (SDK :class:`~edged.client.AsyncSandbox`), each running the
   project's tests; a per-sandbox summary (create latency, run time, pass/fail counts) and
   totals. Everything is torn down at the end (sandboxes, daemon, layer mounts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_ROOTFS = "/var/cache/edged-test/debian-rootfs.tar"
DEFAULT_PROJECT = "more-itertools==10.5.0"
_SUMMARY_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


@dataclass
class Outcome:
    """One sandbox of the batch. Times in seconds; counts from pytest's summary line."""

    id: str
    create_s: float
    run_s: float
    exit_code: int | None
    reason: str
    passed: int
    failed: int
    skipped: int
    summary: str


def _log(msg: str) -> None:
    print(f"rollout: {msg}", file=sys.stderr, flush=True)


def ensure_rootfs(path: str) -> str:
    """The Debian rootfs tarball at ``path``, made with mmdebstrap if missing."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        _log(f"making {path} with mmdebstrap (minbase + python3, bookworm)")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # mmdebstrap picks its output format from the name: keep the .tar ending.
        part = os.path.join(os.path.dirname(path) or ".", f".rootfs.{os.getpid()}.tar")
        try:
            subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase",
                            "--include=python3", "bookworm", part], check=True)
            os.replace(part, path)
        finally:
            Path(part).unlink(missing_ok=True)
    return path


def fetch_sdist(requirement: str, dest: Path) -> tuple[str, Path]:
    """Download ``requirement``'s sdist from PyPI and unpack it; returns (name, source dir)."""
    dl = dest / "dl"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--no-binary", ":all:", "-d", str(dl), requirement], check=True)
    (archive,) = list(dl.iterdir())
    out = dest / "src"
    with tarfile.open(archive) as tf:
        tf.extractall(out, filter="data")
    (top,) = list(out.iterdir())
    name = re.split(r"[=<>!~ \[]", requirement, maxsplit=1)[0]
    return name, top


def build_layers(store_dir: str | None, rootfs: str, requirement: str, test_deps: list[str],
                 work: Path) -> tuple[dict[str, str], str, str]:
    """Build base, workspace and toolkit layers into the store; returns ({kind: digest},
    project name, project dir inside the sandbox)."""
    from layerfs.build import build_layer
    from layerfs.store import Store

    store = Store(store_dir or None)
    # The workspace and toolkit trees are made of fresh files (copies, pip): clamp their
    # mtimes to SOURCE_DATE_EPOCH so that a rebuild of the same inputs gives the same
    # digests and the store dedups whole layers across rollouts. The base keeps its
    # tarball's mtimes: clamping them would make Debian's timestamp-based .pyc stale.
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1700000000")
    digests: dict[str, str] = {}
    t0 = time.monotonic()
    digests["base"] = build_layer(ensure_rootfs(rootfs), kind="base", store=store).digest
    _log(f"base layer {digests['base'][:19]} ({time.monotonic() - t0:.1f}s)")

    name, src = fetch_sdist(requirement, work / "sdist")
    ws = work / "workspace"
    inside = f"/work/{name}"
    shutil.copytree(src, ws / inside.lstrip("/"), symlinks=True)
    t0 = time.monotonic()
    digests["workspace"] = build_layer(str(ws), kind="workspace", store=store,
                                       clamp_mtime=True).digest
    _log(f"workspace layer {digests['workspace'][:19]} from {src.name} "
         f"({time.monotonic() - t0:.1f}s)")

    tk = work / "toolkit"
    target = tk / "opt" / "toolkit"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile",
                    "--target", str(target), "pytest", *test_deps], check=True)
    # .pyc compiled here, so that no sandbox compiles pytest again: checked-hash ones
    # (PEP 552: valid whatever the clamped mtimes) naming their sources by the paths they
    # have in the sandbox (pip's would name this temporary directory, so that no two
    # rollouts would give the same layer).
    done = subprocess.run([sys.executable, "-m", "compileall", "-q", "-d", "/opt/toolkit",
                           "--invalidation-mode", "checked-hash", str(target)],
                          check=False, stdout=subprocess.DEVNULL)
    if done.returncode != 0:  # a file that does not compile: Python compiles it on import
        _log("toolkit: some .py files did not compile ahead of time")
    t0 = time.monotonic()
    digests["toolkit"] = build_layer(str(tk), kind="toolkit", store=store,
                                     clamp_mtime=True).digest
    _log(f"toolkit layer {digests['toolkit'][:19]} ({time.monotonic() - t0:.1f}s)")
    return digests, name, inside


def parse_pytest(output: str) -> tuple[int, int, int, str]:
    """(passed, failed+errors, skipped, summary line) from pytest's last summary line."""
    lines = [x for x in output.strip().splitlines() if _SUMMARY_RE.search(x)]
    if not lines:
        return 0, 0, 0, ""
    last = lines[-1].strip("= ")
    counts: dict[str, int] = {}
    for n, kind in _SUMMARY_RE.findall(last):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    return (counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0),
            counts.get("skipped", 0), last)


async def run_batch(socket: str, image: str, project_dir: str, n: int, parallel: int,
                    timeout: float, cpus: float, memory: int) -> list[Outcome]:
    """Run ``n`` sandboxes (``parallel`` at a time), each running the project's tests."""
    from edged.client import AsyncSandbox

    sem = asyncio.Semaphore(parallel)
    argv = ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]

    run_id = uuid.uuid4().hex[:8]  # two rollouts on a node never share sandbox ids

    async def one(i: int) -> Outcome:
        async with sem:
            sid = f"rollout-{run_id}-{i}"
            t0 = time.monotonic()
            sbx = await AsyncSandbox.create(
                image=image, id=sid, cpus=cpus, memory_bytes=memory, timeout=timeout + 60,
                env={"PYTHONPATH": "/opt/toolkit", "PYTHONDONTWRITEBYTECODE": "1",
                     "HOME": "/tmp", "PATH": "/usr/local/bin:/usr/bin:/bin"},
                labels={"job": "rollout"}, socket=socket)
            create_s = time.monotonic() - t0
            try:
                t1 = time.monotonic()
                r = await sbx.exec(argv, cwd=project_dir, timeout=timeout,
                                   output_limit=16 << 20)
                run_s = time.monotonic() - t1
            finally:
                await sbx.kill()
                await sbx.close()
            passed, failed, skipped, summary = parse_pytest(r.stdout)
            return Outcome(sid, create_s, run_s, r.exit_code, r.reason, passed, failed,
                           skipped, summary or (r.stdout + r.stderr).strip()[-200:])

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def report(outcomes: list[Outcome], wall_s: float, digests: dict[str, str],
           requirement: str) -> dict[str, Any]:
    """Totals of a batch (what ``--json`` prints)."""
    creates = [o.create_s for o in outcomes]
    runs = [o.run_s for o in outcomes]
    ok = [o for o in outcomes if o.exit_code == 0 and o.failed == 0 and o.passed > 0]
    return {
        "project": requirement,
        "layers": digests,
        "sandboxes": len(outcomes),
        "succeeded": len(ok),
        "tests_passed": sum(o.passed for o in outcomes),
        "tests_failed": sum(o.failed for o in outcomes),
        "create_s": {"p50": statistics.median(creates), "p99": _pct(creates, 99),
                     "max": max(creates)},
        "run_s": {"p50": statistics.median(runs), "max": max(runs)},
        "wall_s": wall_s,
        "outcomes": [asdict(o) for o in outcomes],
    }


def print_human(rep: dict[str, Any]) -> None:
    """The per-sandbox table and the totals."""
    hdr = f"{'SANDBOX':<12} {'CREATE':>8} {'RUN':>8} {'EXIT':>5} {'PASS':>5} {'FAIL':>5}  SUMMARY"
    print(hdr)
    for o in rep["outcomes"]:
        code = o["exit_code"] if o["exit_code"] is not None else o["reason"]
        print(f"{o['id']:<12} {o['create_s'] * 1000:>6.1f}ms {o['run_s']:>7.2f}s {code!s:>5} "
              f"{o['passed']:>5} {o['failed']:>5}  {o['summary'][:60]}")
    c, r = rep["create_s"], rep["run_s"]
    print(f"\n{rep['project']}: {rep['succeeded']}/{rep['sandboxes']} sandboxes green, "
          f"{rep['tests_passed']} tests passed, {rep['tests_failed']} failed; "
          f"create p50 {c['p50'] * 1000:.1f} ms, p99 {c['p99'] * 1000:.1f} ms; "
          f"run p50 {r['p50']:.2f} s; wall {rep['wall_s']:.1f} s")


def _remove_cgroup_subtree(runtime_dir: str) -> None:
    """Remove the (now empty) cgroup parents the container backend made for ``runtime_dir``
    (``edged-<sha256(path)[:10]>`` under each hierarchy), so a rollout leaves nothing."""
    import hashlib

    name = "edged-" + hashlib.sha256(str(Path(runtime_dir).resolve()).encode()).hexdigest()[:10]
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        if name in dirnames:
            try:
                os.rmdir(os.path.join(dirpath, name))
            except OSError as e:
                _log(f"cgroup {dirpath}/{name} not removed: {e}")
        if dirpath.count("/") > 6:
            dirnames.clear()


def main(argv: list[str] | None = None) -> int:
    """``edged rollout``; returns 0 if every sandbox's tests passed."""
    p = argparse.ArgumentParser(prog="edged rollout", description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=4, help="sandboxes (default 4)")
    p.add_argument("--parallel", type=int, default=4, help="at a time (default 4)")
    p.add_argument("--project", default=DEFAULT_PROJECT, help="PyPI requirement (sdist)")
    p.add_argument("--test-dep", action="append", default=[], help="extra test dependency")
    p.add_argument("--rootfs", default=DEFAULT_ROOTFS, help="Debian rootfs tarball")
    p.add_argument("--store", default=None, help="layerfs store (default layerfs's)")
    p.add_argument("--timeout", type=float, default=600.0, help="per test run, seconds")
    p.add_argument("--cpus", type=float, default=1.0)
    p.add_argument("--memory", type=int, default=1 << 30, help="bytes per sandbox")
    p.add_argument("--runtime-dir", default=None,
                   help="the rollout daemon's runtime dir (layer mounts, sandbox state); "
                        "default: a private one made for this run under /run")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    from edged.config import Config
    from edged.daemon import Server, ServerThread

    with tempfile.TemporaryDirectory(prefix="edged-rollout-") as tmp:
        work = Path(tmp)
        digests, name, inside = build_layers(a.store, a.rootfs, a.project, a.test_dep, work)
        # A private runtime dir per run (two rollouts at once must not share one: the
        # second daemon's recovery would tear down the first's sandboxes); the cgroup
        # subtree the backend keys on it is removed at the end.
        runtime_dir = a.runtime_dir or tempfile.mkdtemp(
            prefix="edged-rollout-", dir="/run" if os.access("/run", os.W_OK) else None)
        cfg = Config(socket=str(work / "edged.sock"), state_dir=str(work / "state"),
                     runtime_dir=runtime_dir, store_dir=a.store or "",
                     on_shutdown="stop", default_ttl_s=0.0)
        node = ServerThread(Server(cfg), name="edged")
        server = node.server
        try:
            node.start()
            assert server.manager is not None
            image = f"rollout/{name.lower()}:latest"
            server.manager.images.put(image, [digests["base"], digests["workspace"],
                                              digests["toolkit"]])
            _log(f"daemon up; running {a.n} sandboxes of {image}, {a.parallel} at a time")
            t0 = time.monotonic()
            outcomes = asyncio.run(run_batch(cfg.socket, image, inside, a.n, a.parallel,
                                             a.timeout, a.cpus, a.memory))
            rep = report(outcomes, time.monotonic() - t0, digests, a.project)
        finally:
            try:
                node.stop(120)
            finally:
                _remove_cgroup_subtree(runtime_dir)
                if a.runtime_dir is None:  # empty dirs only: never delete through a mount
                    for d, _subdirs, _files in os.walk(runtime_dir, topdown=False):
                        with contextlib.suppress(OSError):
                            os.rmdir(d)
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print_human(rep)
    return 0 if rep["succeeded"] == rep["sandboxes"] else 1
