"""Cold start of a sandbox from lazily loaded layers against pulling the whole image first,
same run, same layers, same chunk server.

    .venv/bin/python bench/bench_lazy_coldstart.py [--json] [--cmd 'import numpy']

Layers: a Debian base (the main job's rootfs tarball, ``mmdebstrap --variant=minbase
--include=python3 bookworm``) and a toolkit holding a real scientific Python stack from
PyPI (numpy, scipy, pandas, scikit-learn, matplotlib, sympy, pyarrow, polars, OpenCV,
statsmodels, numba), installed with pip into ``usr/local/lib/python3.11/dist-packages``
(cached under /var/cache/edged-test). Both are built with ``layerfs build`` (1 MiB chunks
unless ``--chunk-size``)
and served by ``layerfs serve`` on 127.0.0.1.

For each way, from an empty node cache, the clock runs from "start the sandbox" to the
first byte of output of ``python3 -c '<cmd>; print("ok")'`` run by chroot in an overlay of
the two layers (toolkit over base, tmpfs upper):

- lazy: start the lazy server, register both layers, mount them (EROFS on the lazy files),
  overlay, run: only chunks read are fetched;
- full pull: fetch every chunk of both layers (8 in flight, verified), write the two image
  files, mount them, overlay, run.

Printed: seconds to first output, bytes fetched, fraction of the image bytes, and the
ratios (goal: lazy fetches <= 5% of the bytes and starts >= 5x sooner). Needs root.
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

from layerfs.build import build_layer
from layerfs.lazy import client
from layerfs.mount import mount_erofs, mount_overlay, umount
from layerfs.remote import open_remote
from layerfs.remote.server import ChunkServer
from layerfs.store import Store

CACHE = os.environ.get("EDGED_TEST_CACHE", "/var/cache/edged-test")
BASE_TAR = os.path.join(CACHE, "debian-rootfs.tar")
SITE = os.path.join(CACHE, "toolkit-site")
PACKAGES = ["numpy", "scipy", "pandas", "scikit-learn", "matplotlib", "sympy", "pyarrow",
            "polars", "opencv-python-headless", "statsmodels", "numba"]


def toolkit_tree(tmp: str) -> str:
    if not os.path.isdir(SITE):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile",
                        "--target", SITE + ".tmp", *PACKAGES], check=True)
        os.rename(SITE + ".tmp", SITE)
    root = os.path.join(tmp, "toolkit")
    dest = os.path.join(root, "usr/local/lib/python3.11")
    os.makedirs(dest)
    shutil.copytree(SITE, os.path.join(dest, "dist-packages"), symlinks=True)
    return root


def run_first_output(root: str, cmd: str) -> float:
    """Seconds until the first byte of stdout of python3 in a chroot of ``root``."""
    t0 = time.perf_counter()
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    p = subprocess.Popen([chroot, root, "/usr/bin/python3", "-c", f"{cmd}; print('ok')"],
                         stdout=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "HOME": "/"})
    assert p.stdout is not None
    first = p.stdout.read(1)
    dt = time.perf_counter() - t0
    p.stdout.close()
    if p.wait() != 0 or first != b"o":
        raise RuntimeError(f"python3 in the sandbox failed (status {p.returncode})")
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
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", scratch],
                       check=True)
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
            got = await asyncio.gather(*(one(i) for i in range(len(m.chunks))))
            os.fsync(fd)
        finally:
            os.close(fd)
    return sum(got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cmd", default="import numpy")
    ap.add_argument("--chunk-size", type=int, default=1 << 20, help="bytes (default 1 MiB)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_lazy_coldstart: needs root")
    if not os.path.exists(BASE_TAR):
        sys.exit(f"bench_lazy_coldstart: {BASE_TAR} missing (run scripts/main.sh once)")

    with tempfile.TemporaryDirectory(prefix="bench-cold.", dir="/var/tmp") as tmp:
        store = Store(os.path.join(tmp, "store"), chunk_size=args.chunk_size)
        base = build_layer(BASE_TAR, kind="base", store=store).manifest
        tool = build_layer(toolkit_tree(tmp), kind="toolkit", store=store).manifest
        total = base.size + tool.size
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        srv = ChunkServer(store, "127.0.0.1:0")
        url = asyncio.run_coroutine_threadsafe(srv.start(), loop).result(30)
        res: dict[str, Any] = {}
        try:
            # -- full pull first ---------------------------------------------------------
            sb = Sandbox(tmp, "full")
            try:
                os.sync()
                t0 = time.perf_counter()
                imgs = []
                fetched = 0
                for m in (base, tool):
                    out = os.path.join(sb.dir, m.digest[7:] + ".erofs")
                    fetched += asyncio.run(pull(url, m.digest, out))
                    imgs.append(out)
                pulled = time.perf_counter() - t0
                lowers = [sb.mount_layer(imgs[1], "tool"), sb.mount_layer(imgs[0], "base")]
                root = sb.overlay(lowers)
                run = run_first_output(root, args.cmd)
                res["full"] = {"seconds": time.perf_counter() - t0, "pull_seconds": pulled,
                               "run_seconds": run, "bytes_fetched": fetched}
            finally:
                sb.close()
            # -- lazy --------------------------------------------------------------------
            sb = Sandbox(tmp, "lazy")
            cache = os.path.join(tmp, "cache")
            proc = None
            try:
                t0 = time.perf_counter()
                proc = client.start(cache)
                c = client.LazyClient(cache)
                files = [c.register(m.digest, url)["file"] for m in (tool, base)]
                lowers = [sb.mount_layer(files[0], "tool"), sb.mount_layer(files[1], "base")]
                root = sb.overlay(lowers)
                run = run_first_output(root, args.cmd)
                st = c.stats()["layers"]
                fetched = sum(int(st[m.digest]["bytes_fetched"]) for m in (base, tool))
                res["lazy"] = {"seconds": time.perf_counter() - t0, "run_seconds": run,
                               "bytes_fetched": fetched,
                               "per_layer": {m.kind: {"size": m.size, "bytes_fetched":
                                                      st[m.digest]["bytes_fetched"]}
                                             for m in (base, tool)}}
            finally:
                sb.close()
                if proc is not None:
                    client.stop(cache, proc=proc)
        finally:
            asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

    out = {"cmd": args.cmd, "chunk_size": args.chunk_size, "image_bytes": total,
           "base_bytes": base.size, "toolkit_bytes": tool.size, **res,
           "fraction_fetched_lazy": res["lazy"]["bytes_fetched"] / total,
           "speedup_lazy_over_full": res["full"]["seconds"] / res["lazy"]["seconds"],
           "goal": "fraction <= 0.05 and speedup >= 5"}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    mib = 2 ** 20
    print(f"image: base {base.size / mib:.0f} MiB + toolkit {tool.size / mib:.0f} MiB = "
          f"{total / mib:.0f} MiB in {args.chunk_size >> 10} KiB chunks; command: "
          f"python3 -c '{args.cmd}'")
    print(f"{'way':<10} {'first output s':>15} {'fetched MiB':>12} {'fraction':>9}")
    for way in ("full", "lazy"):
        r = res[way]
        print(f"{way:<10} {r['seconds']:>15.2f} {r['bytes_fetched'] / mib:>12.1f} "
              f"{r['bytes_fetched'] / total:>8.1%}")
    print(f"lazy starts {out['speedup_lazy_over_full']:.1f}x sooner and fetches "
          f"{out['fraction_fetched_lazy']:.1%} of the image (goal: >= 5x, <= 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
