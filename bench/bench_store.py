"""Benchmark the chunk store on a real layer: add (cold, then all chunks deduplicated),
export and verify, against a baseline measured in the same run on the same image: the
`zstd` CLI compressing the whole image at the same level with the same threads, plus
`sha256sum` of it (what any store must at least do to the bytes).

    .venv/bin/python bench/bench_store.py [--image IMG | --tar ROOTFS.tar] [--json]

Default input: the Debian rootfs tarball of the main job, built into an image first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from layerfs.build import build_layer
from layerfs.store import DEFAULT_LEVEL, Store

DEFAULT_TAR = "/var/cache/edged-test/debian-rootfs.tar"


def timed(fn: Callable[[], Any], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", help="an EROFS image (default: build one from --tar)")
    ap.add_argument("--tar", default=DEFAULT_TAR)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    if shutil.which("zstd") is None:
        sys.exit("bench_store: needs the zstd CLI for the baseline")

    with tempfile.TemporaryDirectory(prefix="bench-store.") as tmp:
        image = args.image
        if image is None:
            image = os.path.join(tmp, "layer.erofs")
            build_layer(args.tar, kind="base", store=None, output=image)
        size = os.path.getsize(image)
        workers = args.workers or min(4, os.cpu_count() or 1)

        def cold_add() -> None:
            root = os.path.join(tmp, "store")
            shutil.rmtree(root, ignore_errors=True)
            Store(root, workers=workers).add_image(image, kind="base", source="bench")

        t_add = timed(cold_add)
        store = Store(os.path.join(tmp, "store"), workers=workers)
        t_dedup = timed(lambda: store.add_image(image, kind="base", source="bench"))
        digest = store.layers()[0].digest
        out = os.path.join(tmp, "export.erofs")
        t_export = timed(lambda: store.export(digest, out))
        t_verify = timed(lambda: store.verify(digest))
        stored = store.usage().chunk_bytes

        zst = os.path.join(tmp, "baseline.zst")

        def baseline() -> None:
            subprocess.run(["zstd", "-q", "-f", f"-{DEFAULT_LEVEL}", f"-T{workers}", image,
                            "-o", zst], check=True)
            subprocess.run(["sha256sum", image], check=True, stdout=subprocess.DEVNULL)

        t_base = timed(baseline)
        t_base_d = timed(lambda: subprocess.run(["zstd", "-q", "-d", "-f", zst, "-o",
                                                 os.path.join(tmp, "b.out")], check=True))
        base_size = os.path.getsize(zst)

    mb = size / 1e6
    rows = [
        ("add (cold store)", t_add, t_base, "zstd -3 + sha256sum"),
        ("add (all dedup)", t_dedup, t_base, "zstd -3 + sha256sum"),
        ("export (verified)", t_export, t_base_d, "zstd -d"),
        ("verify", t_verify, t_base_d, "zstd -d"),
    ]
    result = {
        "image_bytes": size, "stored_bytes": stored, "baseline_zstd_bytes": base_size,
        "workers": workers,
        "ops": {name: {"seconds": round(t, 4), "mb_per_s": round(mb / t, 1),
                       "baseline": bname, "baseline_seconds": round(b, 4),
                       "baseline_mb_per_s": round(mb / b, 1),
                       "speedup_vs_baseline": round(b / t, 2)}
                for name, t, b, bname in rows},
    }
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"image {size / 2**20:.1f} MiB; stored {stored / 2**20:.1f} MiB in 1 MiB chunks; "
          f"zstd of the whole image {base_size / 2**20:.1f} MiB; {workers} workers")
    print(f"{'operation':<20}{'MB/s':>9}  {'baseline':<22}{'MB/s':>9}{'ratio':>8}")
    for name, t, b, bname in rows:
        print(f"{name:<20}{mb / t:>9.1f}  {bname:<22}{mb / b:>9.1f}{b / t:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
