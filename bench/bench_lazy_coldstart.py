"""Cold start of a sandbox from lazily loaded layers against pulling the whole image first,
same run, same layers, same chunk server; for one or several chunk sizes.

    .venv/bin/python bench/bench_lazy_coldstart.py [--json] [--chunk-size 256K,1M]

Layers: a Debian base (the main job's rootfs tarball, ``mmdebstrap --variant=minbase
--include=python3 bookworm``), a toolkit holding a real scientific Python stack from PyPI
(numpy, scipy, pandas, scikit-learn, matplotlib, sympy, pyarrow, polars, OpenCV,
statsmodels, numba), installed with pip into ``usr/local/lib/python3.11/dist-packages``
with its ``.pyc`` compiled as pip does by default (cached under /var/cache/edged-test),
and a workspace: a real project's source release
from PyPI with its test suite (``more-itertools``, as in ``edged rollout``) at
``/work/<project>`` and pytest under ``/work/.deps``. All are built with ``layerfs build``
at each chunk size (the default: the store's) and served by a chunk server on 127.0.0.1.
Files keep their mtimes (no clamping), so the images' ``.pyc`` are valid, as in an image
built from a real install.

Two cases, each from an empty node cache, the clock running from "start the sandbox" to
the first byte of output, in a chroot of an overlay of the layers (tmpfs upper):

- ``import``: ``python3 -c 'import numpy; print("ok")'`` over toolkit + base;
- ``pytest``: ``python3 -m pytest -q`` in the project over workspace + toolkit + base.

Each case two ways: lazy (register the layers with the node's lazy server, mount them,
overlay, run: only chunks read are fetched) and full pull (fetch every chunk of the layers,
8 in flight, verified, write the image files without flushing them, mount, overlay, run).
Most of the image is the toolkit, which the pytest case barely reads: as in the issue's
setting (one toolkit for many workspaces), the fraction fetched and the full pull's time
are dominated by bytes a start never needs. The lazy server is a
node service that edged starts once at daemon start-up, so its start (a fresh one per case,
on an empty cache) is timed apart and printed, not charged to the sandbox start.

Printed per chunk size and case: seconds to first output, bytes fetched, the fraction of
the image's bytes, chunks fetched (requests), the manifests' bytes, and the ratios (goal:
lazy fetches <= 5% of the bytes and starts >= 5x sooner). Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from edged.projects.sdist import fetch_sdist
from layerfs.build import build_layer
from layerfs.lazy import client
from layerfs.manifest import Manifest
from layerfs.mount import mount_erofs, mount_overlay, mount_tmpfs, umount
from layerfs.remote import open_remote
from layerfs.remote.server import ChunkServer
from layerfs.store import DEFAULT_CHUNK_SIZE, Store

CACHE = os.environ.get("EDGED_TEST_CACHE", "/var/cache/edged-test")
BASE_TAR = os.path.join(CACHE, "debian-rootfs.tar")
SITE = os.path.join(CACHE, "toolkit-site")
WS_DEPS = os.path.join(CACHE, "workspace-deps")
PROJECT = "more-itertools==10.5.0"
PACKAGES = ["numpy", "scipy", "pandas", "scikit-learn", "matplotlib", "sympy", "pyarrow",
            "polars", "opencv-python-headless", "statsmodels", "numba"]


def pip_target(target: str, packages: list[str]) -> None:
    """``pip install --target`` into ``target`` once (cached), with ``.pyc`` compiled
    (timestamp-based, as pip does by default; an older cache made with --no-compile is
    compiled now)."""
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}  # timestamps
    if not os.path.isdir(target):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target",
                        target + ".tmp", *packages], check=True, env=env)
        os.rename(target + ".tmp", target)
    marker = os.path.join(target, ".bench-compiled")
    if not os.path.exists(marker):
        # Exit status 1 only means some file (a test fixture) does not compile.
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", target],
                       stdout=subprocess.DEVNULL, check=False, env=env)
        open(marker, "w").close()


def toolkit_tree(tmp: str) -> str:
    pip_target(SITE, PACKAGES)
    root = os.path.join(tmp, "toolkit")
    dest = os.path.join(root, "usr/local/lib/python3.11")
    os.makedirs(dest)
    shutil.copytree(SITE, os.path.join(dest, "dist-packages"), symlinks=True)
    return root


def workspace_tree(tmp: str) -> tuple[str, str]:
    """The workspace layer's tree and the project directory inside the sandbox."""
    pip_target(WS_DEPS, ["pytest"])
    from pathlib import Path

    sdist = fetch_sdist(PROJECT, Path(tmp) / "sdist")
    name, src = sdist.name, str(sdist.root)
    root = os.path.join(tmp, "workspace")
    inside = f"/work/{name}"
    shutil.copytree(src, root + inside, symlinks=True)
    shutil.copytree(WS_DEPS, os.path.join(root, "work", ".deps"), symlinks=True)
    return root, inside


def run_first_output(root: str, argv: list[str], cwd: str = "/") -> float:
    """Seconds until the first byte of stdout of ``argv`` in a chroot of ``root`` (which
    must then finish with status 0)."""
    t0 = time.perf_counter()
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    script = 'cd "$0" && exec "$@"'
    p = subprocess.Popen([chroot, root, "/bin/sh", "-c", script, cwd, *argv],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env={"PATH": "/usr/bin:/bin", "HOME": "/tmp",
                              "PYTHONPATH": "/work/.deps", "PYTHONDONTWRITEBYTECODE": "1"})
    assert p.stdout is not None
    first = p.stdout.read(1)
    dt = time.perf_counter() - t0
    rest = p.stdout.read()
    p.stdout.close()
    if p.wait() != 0 or not first:
        raise RuntimeError(f"{argv} in the sandbox failed (status {p.returncode}): "
                           f"{(first + rest)[-400:]!r}")
    return dt


class Sandbox:
    """Mounts of one sandbox start, undone by close()."""

    def __init__(self, tmp: str, name: str) -> None:
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir)
        self.mounts: list[str] = []

    def mount_layer(self, image: str, name: str) -> str:
        mp = os.path.join(self.dir, name)
        os.mkdir(mp)
        mount_erofs(image, mp)
        self.mounts.append(mp)
        return mp

    def overlay(self, lowers_top_first: list[str]) -> str:
        scratch = os.path.join(self.dir, "scratch")
        os.mkdir(scratch)
        mount_tmpfs(scratch, size=256 << 20)
        self.mounts.append(scratch)
        for d in ("upper", "work"):
            os.mkdir(os.path.join(scratch, d))
        root = os.path.join(self.dir, "root")
        os.mkdir(root)
        mount_overlay(lowers_top_first, os.path.join(scratch, "upper"),
                      os.path.join(scratch, "work"), root)
        self.mounts.append(root)
        return root

    def close(self) -> None:
        for mp in reversed(self.mounts):
            try:
                umount(mp)
            except OSError:
                umount(mp, lazy=True)
        self.mounts.clear()


async def pull(url: str, digest: str, out: str, concurrency: int = 8) -> int:
    """Download every chunk of a layer (verified) into ``out``; returns bytes fetched."""
    async with open_remote(url) as r:
        m = await r.manifest(digest)
        sem = asyncio.Semaphore(concurrency)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            async def one(i: int) -> int:
                async with sem:
                    data = await r.chunk(m.chunks[i].digest, length=m.chunk_length(i))
                await asyncio.to_thread(os.pwrite, fd, data, i * m.chunk_size)
                return len(data)
            # No fsync: the lazy side does not flush what it fetches before a read uses
            # it either (a puller that did would take ~0.75 s more here).
            got = await asyncio.gather(*(one(i) for i in range(len(m.chunks))))
        finally:
            os.close(fd)
    return sum(got)


CASES = {
    # name: (layers top first, argv, cwd)
    "import": (("toolkit", "base"), ["python3", "-c", "import numpy; print('ok')"], "/"),
    "pytest": (("workspace", "toolkit", "base"),
               ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="],
               "PROJECT"),
}


def measure(url: str, layers: dict[str, Manifest], case: str, project: str,
            tmp: str) -> dict[str, Any]:
    """One case both ways (full pull first) from empty caches; ``tmp`` is a fresh
    directory."""
    kinds, argv, cwd = CASES[case]
    cwd = project if cwd == "PROJECT" else cwd
    ms = [layers[k] for k in kinds]
    total = sum(m.size for m in ms)
    res: dict[str, Any] = {"image_bytes": total, "layers": list(kinds)}
    sb = Sandbox(tmp, f"{case}-full")
    try:
        os.sync()
        t0 = time.perf_counter()
        imgs, fetched = [], 0
        for m in ms:
            out = os.path.join(sb.dir, m.digest[7:] + ".erofs")
            fetched += asyncio.run(pull(url, m.digest, out))
            imgs.append(out)
        pulled = time.perf_counter() - t0
        lowers = [sb.mount_layer(img, k) for img, k in zip(imgs, kinds, strict=True)]
        root = sb.overlay(lowers)
        ready = time.perf_counter() - t0
        run = run_first_output(root, argv, cwd)
        res["full"] = {"seconds": ready + run, "pull_seconds": pulled,
                       "run_seconds": run, "bytes_fetched": fetched,
                       "chunks_fetched": sum(len(m.chunks) for m in ms)}
    finally:
        sb.close()
    sb = Sandbox(tmp, f"{case}-lazy")
    cache = os.path.join(tmp, f"cache-{case}")
    proc = None
    try:
        # The lazy server is a node service (edged starts it once, at daemon start-up):
        # its start is timed apart, not charged to the sandbox start.
        ts = time.perf_counter()
        proc = client.start(cache)
        t0 = t1 = time.perf_counter()
        c = client.LazyClient(cache)
        files = [c.register(m.digest, url)["file"] for m in ms]
        t2 = time.perf_counter()
        lowers = [sb.mount_layer(f, k) for f, k in zip(files, kinds, strict=True)]
        root = sb.overlay(lowers)
        t3 = time.perf_counter()
        run = run_first_output(root, argv, cwd)
        secs = t3 - t0 + run
        st = c.stats()["layers"]
        res["lazy"] = {"seconds": secs, "run_seconds": run, "server_start_seconds": t1 - ts,
                       "register_seconds": t2 - t1, "mount_seconds": t3 - t2,
                       "bytes_fetched": sum(int(st[m.digest]["bytes_fetched"]) for m in ms),
                       "chunks_fetched": sum(int(st[m.digest]["chunks_fetched"]) for m in ms),
                       "fuse_reads": sum(int(st[m.digest]["reads"]) for m in ms),
                       "fuse_read_bytes": sum(int(st[m.digest]["read_bytes"]) for m in ms),
                       "fetch_seconds_mean": sum(st[m.digest]["fetch_latency"]["sum"]
                                                 for m in ms) / max(1, sum(
                           st[m.digest]["fetch_latency"]["count"] for m in ms)),
                       "per_layer": {k: {"size": m.size,
                                         "bytes_fetched": st[m.digest]["bytes_fetched"]}
                                     for k, m in zip(kinds, ms, strict=True)}}
    finally:
        sb.close()
        if proc is not None:
            client.stop(cache, proc=proc)
        shutil.rmtree(cache, ignore_errors=True)
    res["fraction_fetched_lazy"] = res["lazy"]["bytes_fetched"] / total
    res["speedup_lazy_over_full"] = res["full"]["seconds"] / res["lazy"]["seconds"]
    res["manifest_bytes"] = sum(len(m.to_json()) for m in ms)
    return res


def parse_size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    return int(t.rstrip("KM")) * mult


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-size", default=str(DEFAULT_CHUNK_SIZE),
                    help="bytes, K or M suffix; comma-separated for several "
                         f"(default {DEFAULT_CHUNK_SIZE >> 10}K, the store's)")
    ap.add_argument("--cases", default="import,pytest")
    ap.add_argument("--repeat", type=int, default=1,
                    help="tries per chunk size and case; the median (by speedup) is shown")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_lazy_coldstart: needs root")
    if not os.path.exists(BASE_TAR):
        sys.exit(f"bench_lazy_coldstart: {BASE_TAR} missing (run scripts/main.sh once)")
    sizes = [parse_size(x) for x in args.chunk_size.split(",")]
    cases = args.cases.split(",")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cold.", dir="/var/tmp") as tmp:
        trees = {"base": BASE_TAR, "toolkit": toolkit_tree(tmp)}
        trees["workspace"], project = workspace_tree(tmp)
        for csize in sizes:
            store = Store(os.path.join(tmp, f"store-{csize}"), chunk_size=csize)
            layers = {k: build_layer(src, kind=k, store=store).manifest
                      for k, src in trees.items()}
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, daemon=True)
            thread.start()
            srv = ChunkServer(store, "127.0.0.1:0")
            url = asyncio.run_coroutine_threadsafe(srv.start(), loop).result(30)
            try:
                for case in cases:
                    tries = []
                    for _ in range(args.repeat):
                        work = tempfile.mkdtemp(prefix=f"{csize}-{case}.", dir=tmp)
                        tries.append(measure(url, layers, case, project, work))
                        shutil.rmtree(work, ignore_errors=True)
                    # the median try by speedup; every try's figures are kept
                    tries.sort(key=lambda t: t["speedup_lazy_over_full"])
                    r = tries[len(tries) // 2]
                    runs.append({"chunk_size": csize, "case": case, **r,
                                 "tries": [{"full_seconds": t["full"]["seconds"],
                                            "lazy_seconds": t["lazy"]["seconds"],
                                            "fraction": t["fraction_fetched_lazy"]}
                                           for t in tries]})
            finally:
                asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(30)
                loop.call_soon_threadsafe(loop.stop)
                thread.join(10)
                shutil.rmtree(store.root, ignore_errors=True)

    out = {"runs": runs, "goal": "fraction_fetched_lazy <= 0.05 and "
                                 "speedup_lazy_over_full >= 5"}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    mib = 2 ** 20
    print(f"{'chunk':>6} {'case':<7} {'image MiB':>9} {'full s':>7} {'lazy s':>7} "
          f"{'sooner':>7} {'lazy MiB':>9} {'fraction':>9} {'requests':>9} "
          f"{'manifests KiB':>14} {'server start s':>15}")
    for r in runs:
        print(f"{r['chunk_size'] >> 10:>5}K {r['case']:<7} {r['image_bytes'] / mib:>9.0f} "
              f"{r['full']['seconds']:>7.2f} {r['lazy']['seconds']:>7.2f} "
              f"{r['speedup_lazy_over_full']:>6.1f}x "
              f"{r['lazy']['bytes_fetched'] / mib:>9.1f} "
              f"{r['fraction_fetched_lazy']:>8.1%} {r['lazy']['chunks_fetched']:>9} "
              f"{r['manifest_bytes'] / 1024:>14.0f} "
              f"{r['lazy']['server_start_seconds']:>15.2f}")
    print("goal: lazy fetches <= 5% of the image and starts >= 5x sooner than a full pull")
    return 0


if __name__ == "__main__":
    sys.exit(main())
