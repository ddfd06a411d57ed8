#!/usr/bin/env python3
"""Build benchmark: layerfs against mkfs.erofs, the same tree in the same run.

    .venv/bin/python bench/bench_build.py [--src DIR | --tar ROOTFS.tar] [--runs 5] [--json]

Default source: the cached Debian rootfs tarball (``mmdebstrap --variant=minbase
--include=python3 bookworm``, see tests/layerfs/conftest.py), extracted as root into a
temporary directory. Every builder runs as a child process (interpreter start-up
included) on the same tree, in turn, after one warm-up each (page cache warm for all:
this measures the builders, not the disk):

- ``layerfs``: the library build, ``write_image(scan_directory(SRC), fd)`` into a new
  file: the C scan and the C writer, the same work as the baseline (an image in the
  page cache);
- ``layerfs durable``: ``write_image(scan_directory(SRC), IMAGE)``, which also makes the
  image durable (fsync of a temp file, then the rename) as ``layerfs build -o`` does;
- ``layerfs build``: the CLI, ``layerfs build SRC --kind base --no-store -o IMAGE``
  (durable, and it also computes the image's sha256 digest, which it prints);
- ``mkfs.erofs`` 1.5, uncompressed with a fixed uuid and build time (``-T0 -U``), the
  baseline (it writes the same kind of image; it neither fsyncs nor hashes it).

Reported per builder: median wall time of the child, its median CPU time (user +
system, from wait4: less sensitive to a loaded machine than the wall time), MB/s
(regular file bytes / s), files/s (inodes / s), peak RSS (ru_maxrss of the child) and
image size; then each ratio mkfs.erofs time / builder time (wall, and CPU), and the load
average before and after (``/proc/loadavg``; the machine may be shared). Importable:
:func:`measure`, :func:`ours_cmd`, :func:`mkfs_cmd`, :func:`run_bench` (other
benchmarks add modes).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_TAR = pathlib.Path(os.environ.get("EDGED_TEST_CACHE", "/var/cache/edged-test")) \
    / "debian-rootfs.tar"
FIXED_UUID = "00000000-0000-0000-0000-000000000000"


@dataclass
class Run:
    seconds: float
    max_rss_kib: int
    image_bytes: int
    cpu_seconds: float = 0.0    # user + system of the child (wait4 rusage)


@dataclass
class Result:
    name: str
    runs: list[Run]
    data_bytes: int
    inodes: int

    @property
    def median_s(self) -> float:
        return statistics.median(r.seconds for r in self.runs)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(r.cpu_seconds for r in self.runs)

    def summary(self) -> dict[str, float | int | str]:
        s = self.median_s
        return {"name": self.name, "median_s": round(s, 4),
                "median_cpu_s": round(self.median_cpu_s, 4),
                "mb_per_s": round(self.data_bytes / s / 1e6, 1),
                "files_per_s": round(self.inodes / s),
                "peak_rss_mib": round(max(r.max_rss_kib for r in self.runs) / 1024, 1),
                "image_bytes": self.runs[-1].image_bytes,
                "runs_s": [round(r.seconds, 4) for r in self.runs]}


def measure(cmd: Sequence[str], image: pathlib.Path) -> Run:
    """Run ``cmd`` as a child; its wall time, peak RSS and CPU time (user + system,
    wait4 rusage) and image size."""
    if image.exists():
        image.unlink()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=ROOT)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, rusage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return Run(seconds, rusage.ru_maxrss, image.stat().st_size,
               rusage.ru_utime + rusage.ru_stime)


# The library build's child: only what a caller of the library imports (this file's own
# imports, argparse, statistics, subprocess..., cost ~25 ms of CPU that no build needs).
_CHILD = """\
import os, sys
from layerfs.sources.directory import scan_directory
from layerfs.writer import write_image
mode, src, image = sys.argv[1:]
if mode == "durable":
    write_image(scan_directory(src), image)
else:
    fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        write_image(scan_directory(src), fd)
    finally:
        os.close(fd)
"""


def ours_cmd(src: pathlib.Path, image: pathlib.Path, *, durable: bool = False) -> list[str]:
    """The layerfs library build as a child process (interpreter start-up included),
    run in the checkout (``measure`` sets the working directory)."""
    return [sys.executable, "-c", _CHILD, "durable" if durable else "page-cache", str(src),
            str(image)]


def durable_cmd(src: pathlib.Path, image: pathlib.Path) -> list[str]:
    return ours_cmd(src, image, durable=True)


def cli_cmd(src: pathlib.Path, image: pathlib.Path) -> list[str]:
    """``layerfs build`` as users run it, without a store (it still digests the image)."""
    return [sys.executable, "-m", "layerfs.cli", "build", str(src), "--kind", "base",
            "--no-store", "-o", str(image)]


def mkfs_cmd(src: pathlib.Path, image: pathlib.Path) -> list[str]:
    return ["mkfs.erofs", "-T0", "-U", FIXED_UUID, str(image), str(src)]


def _tree_size(src: pathlib.Path) -> tuple[int, int]:
    data = inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(src):
        inodes += 1
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            inodes += 1
            if os.path.isfile(os.path.join(dirpath, n)) and not os.path.islink(
                    os.path.join(dirpath, n)):
                data += st.st_size
    return data, inodes


Builder = tuple[str, Callable[[pathlib.Path, pathlib.Path], list[str]]]
BUILDERS: list[Builder] = [("layerfs", ours_cmd), ("layerfs durable", durable_cmd),
                           ("layerfs build", cli_cmd), ("mkfs.erofs", mkfs_cmd)]


def run_bench(src: pathlib.Path, workdir: pathlib.Path, runs: int = 3,
              builders: Sequence[Builder] = BUILDERS) -> list[Result]:
    """Warm up, then alternate the builders ``runs`` times on ``src``."""
    data, inodes = _tree_size(src)
    results = [Result(name, [], data, inodes) for name, _ in builders]
    for _, make in builders:  # warm-up: page cache, dentries
        measure(make(src, workdir / "warm.img"), workdir / "warm.img")
    for _ in range(runs):
        for res, (name, make) in zip(results, builders, strict=True):
            img = workdir / f"{name}.img"
            res.runs.append(measure(make(src, img), img))
    for f in workdir.glob("*.img"):
        f.unlink()
    return results


def report(results: list[Result]) -> str:
    rows = [r.summary() for r in results]
    lines = [f"{'builder':<16} {'median s':>9} {'CPU s':>6} {'MB/s':>8} {'files/s':>9} "
             f"{'peak RSS MiB':>13} {'image MiB':>10}"]
    for r in rows:
        lines.append(f"{r['name']:<16} {r['median_s']:>9.3f} {r['median_cpu_s']:>6.3f} "
                     f"{r['mb_per_s']:>8.1f} "
                     f"{r['files_per_s']:>9} {r['peak_rss_mib']:>13.1f} "
                     f"{int(r['image_bytes']) / 2**20:>10.1f}")
    base, base_cpu = results[-1].median_s, results[-1].median_cpu_s
    for r in results[:-1]:
        lines.append(f"speed-up of {r.name} over {results[-1].name}: "
                     f"{base / r.median_s:.2f}x wall, {base_cpu / r.median_cpu_s:.2f}x CPU "
                     f"(median of {len(r.runs)})")
    return "\n".join(lines)


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=pathlib.Path, help="directory to build from")
    ap.add_argument("--tar", type=pathlib.Path, default=DEFAULT_TAR,
                    help="rootfs tarball to extract when --src is not given")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if not shutil.which("mkfs.erofs"):
        print("mkfs.erofs not found (apt install erofs-utils)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-build-", dir="/var/tmp") as tmp:
        work = pathlib.Path(tmp)
        src = args.src
        if src is None:
            if not args.tar.exists():
                print(f"{args.tar} missing: build it with mmdebstrap (see "
                      "tests/layerfs/conftest.py)", file=sys.stderr)
                return 2
            src = work / "rootfs"
            src.mkdir()
            subprocess.run(["tar", "-xpf", str(args.tar), "--xattrs", "--xattrs-include=*",
                            "--numeric-owner", "-C", str(src)], check=True)
        load_before = _loadavg()
        results = run_bench(src, work, args.runs)
        load_after = _loadavg()
    if args.json:
        base = results[-1].median_s
        print(json.dumps({"source": str(args.src or args.tar),
                          "data_bytes": results[0].data_bytes,
                          "inodes": results[0].inodes,
                          "results": [r.summary() for r in results],
                          "baseline": results[-1].name,
                          "ratios": {r.name: round(base / r.median_s, 3)
                                     for r in results[:-1]},
                          "cpu_ratios": {r.name: round(results[-1].median_cpu_s
                                                       / r.median_cpu_s, 3)
                                         for r in results[:-1]},
                          "raw": {r.name: [asdict(x) for x in r.runs] for r in results},
                          "loadavg_before": load_before, "loadavg_after": load_after},
                         indent=2))
    else:
        print(report(results))
        print(f"load average before {load_before}, after {load_after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
