"""Build the small executables that are not part of the cffi module: ``sbx-init`` (static,
PID 1 of every sandbox) and ``edged-spawner`` (makes a container sandbox).

Run by setup.py's build step (``pip install .`` and ``pip install -e .``), or directly for
development: ``python csrc/build_bins.py [OUT_DIR]`` (default ``edged/_bin``). sbx-init is
linked statically (musl-gcc when installed: a ~100 KiB binary; else glibc ``-static``) because
it runs inside sandboxes whose rootfs may have no libc at all.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-D_GNU_SOURCE"]

BINARIES = {
    # name: (sources, prefer musl)
    "sbx-init": (["sbx-init/sbx-init.c"], True),
    "edged-spawner": (["spawner/spawner.c"], False),
}


def _compile(out: pathlib.Path, sources: list[str], musl: bool) -> None:
    srcs = [str(CSRC / s) for s in sources]
    cc = os.environ.get("CC", "cc")
    attempts = []
    if musl and shutil.which("musl-gcc"):
        attempts.append(["musl-gcc", "-static", "-Os", *CFLAGS[1:]])
    attempts.append([cc, "-static", *CFLAGS])
    if not musl:
        attempts.append([cc, *CFLAGS])  # no static libc installed: dynamic is fine on the host
    last = ""
    for cmd in attempts:
        tmp = out.with_suffix(".tmp")
        proc = subprocess.run([*cmd, "-o", str(tmp), *srcs], capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, out)
            return
        last = proc.stderr
    raise RuntimeError(f"building {out.name} failed:\n{last}")


def build(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every binary into ``out_dir``; returns their paths. Raises RuntimeError with
    the compiler's message on failure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for name, (sources, musl) in BINARIES.items():
        out = out_dir / name
        _compile(out, sources, musl)
        built.append(out)
    return built


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "edged" / "_bin"
    for p in build(target):
        print(p)
