"""Through the edged API (SDK → HTTP on the Unix socket → daemon → container backend) against
the same backend called directly in-process, in the same run, on the same EROFS layer.

    .venv/bin/python bench/bench_api.py [--n 100] [--execs 300] [--json]

Needs root. The layer is a busybox-static tree built by layerfs into a temporary store and
mounted file-backed once (the daemon's node layer mount; the direct baseline uses that same
mountpoint). Figures, after one warm-up sandbox each:
- create→first exec: create a sandbox and run `true` until its end is reported (sequential;
  the delete is not timed);
- exec round trip: `true` in one live sandbox, request to end event;
- creates/s: sequential create+first exec+delete cycles per second.
The ratio API/direct is the daemon's cost (HTTP, JSON, state machine, admission, persistence).
Both sides make the same sandbox: the daemon's default task profile (confined) and spawner
pool (``Config().spawner_pool``). The daemon runs as a process of its own, as in production
(``--in-process``: in a thread of this one, where it shares one interpreter lock with the
client).
"""

from __future__ import annotations

import argparse
import asyncio
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_create import busybox_tree

from edged.backends.base import QOS_CLASSES, ExecEnd, ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend
from edged.client import Sandbox
from edged.config import Config
from edged.daemon import Server, ServerThread

ENV = {"PATH": "/bin"}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def busybox_layer(work: Path) -> tuple[str, str]:
    from layerfs.build import build_layer
    from layerfs.store import Store

    root = busybox_tree(work / "root")
    (root / "etc").mkdir()
    store = str(work / "store")
    return store, build_layer(str(root), kind="base", store=Store(store)).digest


def via_api(sock: str, digest: str, n: int, execs: int, qos: str) -> dict[str, list[float]]:
    Sandbox.create(layers=[digest], env=ENV, socket=sock, qos=qos).kill()  # warm-up
    create: list[float] = []
    t_all = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        s = Sandbox.create(layers=[digest], env=ENV, socket=sock, qos=qos)
        s.exec(["true"])
        create.append(time.perf_counter() - t0)
        s.kill()
    cycles = n / (time.perf_counter() - t_all)
    s = Sandbox.create(layers=[digest], env=ENV, socket=sock, qos=qos)
    rt: list[float] = []
    for _ in range(execs):
        t0 = time.perf_counter()
        s.exec(["true"])
        rt.append(time.perf_counter() - t0)
    s.kill()
    return {"create": create, "exec": rt, "cycles_per_s": [cycles]}


async def direct(runtime: str, lower: str, n: int, execs: int,
                 qos: str) -> dict[str, list[float]]:
    b = ContainerBackend(runtime, spawner_pool=Config().spawner_pool)
    await b.warm()
    spec = ExecSpec(argv=("true",), env=ENV)

    async def run(sid: str) -> None:
        h = await b.exec(sid, spec)
        async for ev in h.events():
            if isinstance(ev, ExecEnd):
                return

    def sbx(i: int) -> SandboxSpec:
        return SandboxSpec(id=f"direct-{i}", lowers=(lower,), resources=Resources(), env=ENV,
                           hostname=f"direct-{i}", task_profile="default", qos=qos)

    await b.create(sbx(-1))
    await b.destroy("direct--1")
    create: list[float] = []
    t_all = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        await b.create(sbx(i))
        await run(f"direct-{i}")
        create.append(time.perf_counter() - t0)
        await b.destroy(f"direct-{i}")
    cycles = n / (time.perf_counter() - t_all)
    await b.create(sbx(n))
    rt: list[float] = []
    for _ in range(execs):
        t0 = time.perf_counter()
        await run(f"direct-{n}")
        rt.append(time.perf_counter() - t0)
    await b.destroy(f"direct-{n}")
    await b.close()
    return {"create": create, "exec": rt, "cycles_per_s": [cycles]}


def start_daemon(cfg: Config, in_process: bool) -> Callable[[], None]:
    """Start a daemon on ``cfg``; returns the function that stops it."""
    if in_process:
        node = ServerThread(Server(cfg)).start()

        def stop_thread() -> None:
            node.stop(60)

        return stop_thread
    argv = [sys.executable, "-c", "import sys; from edged.cli import main; sys.exit(main())",
            "serve"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value != f.default:
            argv += ["--" + f.name.replace("_", "-"), str(value)]
    proc = subprocess.Popen(argv, cwd=str(Path(__file__).resolve().parents[1]))
    deadline = time.monotonic() + 30
    while True:
        try:
            Sandbox.list(socket=cfg.socket)
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the daemon did not start") from None
            time.sleep(0.05)

    def stop_process() -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return stop_process


def summarize(d: dict[str, list[float]]) -> dict[str, float]:
    return {
        "create_first_exec_p50_ms": pct(d["create"], 50) * 1e3,
        "create_first_exec_p99_ms": pct(d["create"], 99) * 1e3,
        "exec_roundtrip_p50_ms": pct(d["exec"], 50) * 1e3,
        "exec_roundtrip_p99_ms": pct(d["exec"], 99) * 1e3,
        "cycles_per_s": d["cycles_per_s"][0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100, help="create cycles per contender")
    ap.add_argument("--execs", type=int, default=300, help="exec round trips per contender")
    ap.add_argument("--in-process", action="store_true",
                    help="run the daemon in a thread of this process (shares its GIL)")
    ap.add_argument("--qos", choices=QOS_CLASSES, default=SandboxSpec.qos,
                    help="the sandboxes' CPU class (default: the daemon's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_api: needs root", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="edged-bench-api-"))
    runtime = tempfile.mkdtemp(prefix="edged-bench-api-", dir="/run")
    direct_rt = tempfile.mkdtemp(prefix="edged-bench-direct-", dir="/run")
    try:
        store, digest = busybox_layer(work)
        cfg = Config(socket=str(work / "s.sock"), state_dir=str(work / "state"),
                     runtime_dir=runtime, store_dir=store, log_level="warning",
                     default_ttl_s=0.0)
        stop = start_daemon(cfg, a.in_process)
        try:
            api = summarize(via_api(cfg.socket, digest, a.n, a.execs, a.qos))
            # The baseline runs on the daemon's own layer mount, held by one sandbox.
            keep = Sandbox.create(layers=[digest], env=ENV, socket=cfg.socket)
            lower = str(Path(runtime, "layers", digest.split(":", 1)[1]))
            assert os.path.ismount(lower), lower
            base = summarize(asyncio.run(direct(direct_rt, lower, a.n, a.execs, a.qos)))
            keep.kill()
        finally:
            stop()
    finally:
        for rt in (runtime, direct_rt):
            h = hashlib.sha256(str(Path(rt).resolve()).encode()).hexdigest()[:10]
            for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
                for name in (f"edged-{h}", f"edged-{h}-idle"):
                    if name in dirnames:
                        os.rmdir(os.path.join(dirpath, name))
                if dirpath.count("/") > 6:
                    dirnames.clear()
            shutil.rmtree(rt, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    ratios = {k: api[k] / base[k] for k in api}
    out: dict[str, Any] = {"n": a.n, "execs": a.execs, "api": api, "direct": base,
                           "ratio_api_over_direct": ratios, "loadavg_1min": os.getloadavg()[0]}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'figure':<28}{'API (SDK)':>12}{'direct':>12}{'ratio':>8}")
    for k in api:
        print(f"{k:<28}{api[k]:>12.2f}{base[k]:>12.2f}{ratios[k]:>8.2f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
