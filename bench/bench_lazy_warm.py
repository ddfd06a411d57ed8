"""Warm-cache throughput of a lazily served layer file against the same image on local
disk, same run, same reads.

    .venv/bin/python bench/bench_lazy_warm.py [--image IMG | --size-mib N] [--json]

A layer is pushed to a chunk server on loopback, exposed by the lazy FUSE server, and read
once whole (so every chunk is in the node cache: "warm"). Then, for the lazy file and for
the image file on local disk, the page cache of everything involved (the image, the lazy
file, the layer's cache file) is dropped with POSIX_FADV_DONTNEED and the file is read:

- sequential: 4 KiB preads from start to end (kernel readahead on, as for any reader);
- random: 4 KiB preads at random 4 KiB-aligned offsets (POSIX_FADV_RANDOM: no readahead).

Printed: MB/s and reads/s for both, and the ratio local/lazy throughput (goal: <= 2).
Needs root, /dev/fuse.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from typing import Any

from layerfs.lazy import client
from layerfs.remote.server import ChunkServer
from layerfs.store import DEFAULT_CHUNK_SIZE, Store

BLOCK = 4096


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential(path: str) -> tuple[float, int]:
    fd = os.open(path, os.O_RDONLY)
    n = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        size = os.fstat(fd).st_size
        t0 = time.perf_counter()
        for off in range(0, size, BLOCK):
            n += len(os.pread(fd, BLOCK, off))
        return time.perf_counter() - t0, n
    finally:
        os.close(fd)


def random_reads(path: str, count: int, seed: int) -> tuple[float, int]:
    fd = os.open(path, os.O_RDONLY)
    n = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        blocks = os.fstat(fd).st_size // BLOCK
        rnd = random.Random(seed)
        offs = [rnd.randrange(blocks) * BLOCK for _ in range(count)]
        t0 = time.perf_counter()
        for off in offs:
            n += len(os.pread(fd, BLOCK, off))
        return time.perf_counter() - t0, n
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", help="an image file (default: --size-mib random bytes)")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--random-reads", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3, help="best of N")
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                    help=f"bytes (default {DEFAULT_CHUNK_SIZE}, the store's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        sys.exit("bench_lazy_warm: needs root and /dev/fuse")

    with tempfile.TemporaryDirectory(prefix="bench-lazy.", dir="/var/tmp") as tmp:
        image = args.image
        if image is None:
            image = os.path.join(tmp, "layer.img")
            with open(image, "wb") as f:
                for _ in range(args.size_mib):
                    f.write(os.urandom(1 << 20))
        size = os.path.getsize(image)
        store = Store(os.path.join(tmp, "store"), chunk_size=args.chunk_size)
        digest = store.add_image(image, kind="base", source="bench").digest

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        srv = ChunkServer(store, "127.0.0.1:0")
        url = asyncio.run_coroutine_threadsafe(srv.start(), loop).result(30)
        cache = os.path.join(tmp, "cache")
        proc = client.start(cache)
        try:
            c = client.LazyClient(cache)
            lazy = c.register(digest, url)["file"]
            t0 = time.perf_counter()
            sequential(lazy)  # cold: fetch every chunk
            cold = time.perf_counter() - t0
            # the layer's sparse cache file (layerfs.lazy.cache, layout 2)
            chunk_files = [os.path.join(cache, "data", digest[7:] + ".img")]
            os.sync()  # POSIX_FADV_DONTNEED leaves dirty pages in the page cache
            results: dict[str, Any] = {}
            for mode in ("sequential", "random"):
                for name, path, extra in (("local", image, []), ("lazy", lazy, chunk_files)):
                    best = float("inf")
                    nbytes = 0
                    for r in range(args.repeat):
                        drop_cache([path, *extra])
                        if mode == "sequential":
                            secs, nbytes = sequential(path)
                        else:
                            secs, nbytes = random_reads(path, args.random_reads, seed=r)
                        best = min(best, secs)
                    results.setdefault(mode, {})[name] = {
                        "seconds": best, "bytes": nbytes, "mb_s": nbytes / best / 1e6,
                        "reads_s": nbytes / BLOCK / best}
                res = results[mode]
                res["ratio_local_over_lazy"] = res["local"]["mb_s"] / res["lazy"]["mb_s"]
            st = c.stats()["layers"][digest]
        finally:
            client.stop(cache, proc=proc)
            asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

    out = {"image_bytes": size, "chunk_size": args.chunk_size, "cold_fill_seconds": cold,
           "cold_fill_mb_s": size / cold / 1e6, "results": results,
           "lazy_stats": {k: st[k] for k in ("reads", "hits", "misses", "bytes_fetched")},
           "goal": "ratio_local_over_lazy <= 2"}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(f"image {size / 2**20:.0f} MiB; cold fill over loopback HTTP: {cold:.2f} s "
          f"({size / cold / 1e6:.0f} MB/s)")
    print(f"{'4 KiB reads':<12} {'local MB/s':>11} {'lazy MB/s':>10} {'local r/s':>10} "
          f"{'lazy r/s':>10} {'local/lazy':>10}")
    for mode in ("sequential", "random"):
        r = results[mode]
        print(f"{mode:<12} {r['local']['mb_s']:>11.0f} {r['lazy']['mb_s']:>10.0f} "
              f"{r['local']['reads_s']:>10.0f} {r['lazy']['reads_s']:>10.0f} "
              f"{r['ratio_local_over_lazy']:>9.2f}x")
    print("goal: local/lazy <= 2x on a warm cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
