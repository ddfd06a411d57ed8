"""Build the small executables that are not part of the cffi module: ``sbx-init`` (static,
PID 1 of every sandbox), ``edged-spawner`` (makes a container sandbox),
``edged-vmm-jail`` (starts a microVM's VMM jailed: its cgroups, user, namespaces) and
``fncall-spawn`` (static: the call spawner inside FnCall pool sandboxes).

Run by setup.py's build step (``pip install .`` and ``pip install -e .``), or directly for
development: ``python csrc/build_bins.py [OUT_DIR]`` (default ``edged/_bin``). sbx-init is
linked statically (musl-gcc when installed: a ~100 KiB binary; else glibc ``-static``) because
it runs inside sandboxes whose rootfs may have no libc at all.

It also compiles the egress programs (``csrc/bpf/egress.bpf.c``) with clang ``-target bpf``
into ``egress.bpf.o`` there, which the daemon loads with libbpf (:mod:`edged.net.bpf`); where
clang or the libbpf headers are missing, that object is skipped with a warning (networked
sandboxes are then reported unavailable by ``GET /v1/node``).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-D_GNU_SOURCE", f"-I{CSRC / 'include'}"]
# libc-only confinement code (Landlock, capabilities, seccomp) shared with the cffi module
CONFINE = ["lib/confine.c", "lib/error.c"]

SBX_INIT = sorted(str(p.relative_to(CSRC)) for p in (CSRC / "sbx-init").glob("*.c"))

BINARIES = {
    # name: (sources, prefer musl)
    "sbx-init": ([*SBX_INIT, *CONFINE], True),
    "edged-spawner": (["spawner/spawner.c", *CONFINE], False),
    "edged-vmm-jail": (["vmm-jail/jail.c"], False),
    # static: it runs inside FnCall pool sandboxes (any rootfs)
    "fncall-spawn": (["fncall/spawn.c"], True),
}


def _kernel_headers(out_dir: pathlib.Path) -> list[str]:
    """musl-gcc searches only musl's own include dir; the confinement code needs the kernel
    uapi headers (linux/, asm/, asm-generic/ from linux-libc-dev): link them into a private
    include dir. Returns the extra compiler flags ([] when the headers are not installed)."""
    arch = subprocess.run(["gcc", "-dumpmachine"], capture_output=True, text=True).stdout.strip()
    srcs = {"linux": "/usr/include/linux", "asm-generic": "/usr/include/asm-generic",
            "asm": f"/usr/include/{arch}/asm"}
    if not all(os.path.isdir(p) for p in srcs.values()):
        return []
    inc = out_dir / ".kheaders"
    inc.mkdir(exist_ok=True)
    for name, target in srcs.items():
        link = inc / name
        if not link.is_symlink():
            link.symlink_to(target)
    return ["-isystem", str(inc)]


def _compile(out: pathlib.Path, sources: list[str], musl: bool, tmp_dir: pathlib.Path) -> None:
    srcs = [str(CSRC / s) for s in sources]
    cc = os.environ.get("CC", "cc")
    attempts = []
    if musl and shutil.which("musl-gcc"):
        attempts.append(["musl-gcc", "-static", "-Os", *CFLAGS[1:],
                         *_kernel_headers(tmp_dir)])
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


def _build_bpf(out: pathlib.Path) -> bool:
    """Compile the egress programs into ``out``; False (and a warning) when clang or the
    libbpf headers are not installed."""
    clang = shutil.which("clang") or shutil.which("clang-14")
    if clang is None or not os.path.isfile("/usr/include/bpf/bpf_helpers.h"):
        print("build_bins: no clang or libbpf headers: egress programs not built",
              file=sys.stderr)
        return False
    arch = subprocess.run(["gcc", "-dumpmachine"], capture_output=True, text=True).stdout.strip()
    tmp = out.with_suffix(".tmp")
    # -g: the BTF that libbpf reads the map definitions from; -mcpu=v3: atomics, 32-bit jumps
    cmd = [clang, "-O2", "-g", "-target", "bpf", "-mcpu=v3", "-Wall", "-Werror",
           f"-I{CSRC / 'bpf'}", f"-I/usr/include/{arch}", "-c", str(CSRC / "bpf/egress.bpf.c"),
           "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building {out.name} failed:\n{proc.stderr}")
    os.replace(tmp, out)
    return True


def build(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every binary into ``out_dir``; returns their paths. Raises RuntimeError with
    the compiler's message on failure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (sources, musl) in BINARIES.items():
            out = out_dir / name
            _compile(out, sources, musl, pathlib.Path(tmp))
            built.append(out)
    bpf = out_dir / "egress.bpf.o"
    if _build_bpf(bpf):
        built.append(bpf)
    return built


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "edged" / "_bin"
    for p in build(target):
        print(p)
