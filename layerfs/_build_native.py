"""cffi build script for the private extension ``layerfs._native`` (API mode).

One cdef per C module lives in ``csrc/cdef/<module>.cdef``; every ``csrc/lib/*.c`` is
compiled into the one extension (the internal library). Run by ``pip install .`` through
``cffi_modules`` in setup.py; can also be run directly (``python layerfs/_build_native.py``)
to build in place for development.
"""

from __future__ import annotations

import pathlib
import shlex
import subprocess

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

ffibuilder = FFI()

for cdef in sorted((CSRC / "cdef").glob("*.cdef")):
    ffibuilder.cdef(cdef.read_text())


def _pkg_config(*args: str) -> list[str]:
    return shlex.split(subprocess.run(["pkg-config", *args], check=True,
                                      capture_output=True, text=True).stdout)


# libfuse3 (low-level API) for the lazy layer file server, csrc/lib/lazy.c.
_FUSE_CFLAGS = _pkg_config("--cflags", "fuse3")
_FUSE_LIBS = [f[2:] for f in _pkg_config("--libs", "fuse3") if f.startswith("-l")]

_headers = sorted((CSRC / "include").glob("lfs_*.h"))
_sources = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "lib").glob("*.c"))

ffibuilder.set_source(
    "layerfs._native",
    "\n".join(f'#include "{h.name}"' for h in _headers),
    sources=_sources,
    include_dirs=[str(CSRC / "include")] + [f[2:] for f in _FUSE_CFLAGS if f.startswith("-I")],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-D_GNU_SOURCE",
                        "-fvisibility=hidden"],
    # libseccomp compiles seccomp profiles to BPF (csrc/lib/seccomp.c).
    libraries=[*_FUSE_LIBS, "seccomp"],
)

if __name__ == "__main__":
    import os

    os.chdir(ROOT)
    built = ffibuilder.compile(tmpdir=str(ROOT), verbose=False)
    # `pip install` names the extension _native.abi3.so (cffi builds for the limited API);
    # a copy under this interpreter's own suffix would be imported first and shadow every
    # later pip build, so the in-place build takes the same name.
    target = ROOT / "layerfs" / "_native.abi3.so"
    if pathlib.Path(built).resolve() != target:
        os.replace(built, target)
