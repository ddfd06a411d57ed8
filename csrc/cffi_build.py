"""One cffi build (API mode) of a private extension module from modules of the C core.

A module ``m`` of the core is ``csrc/lib/<m>.c``, with its cdef ``csrc/cdef/<m>.cdef`` and
its header ``csrc/include/lfs_<m>.h`` where it has them. Each package's build script names
the modules it binds and the libraries they need: ``layerfs/_build_native.py`` (the writer,
the scanner and the lazy server: ``layerfs._native``, no libseccomp) and
``edged/_build_native.py`` (confinement and memory advice: ``edged._native``). Both run
through ``cffi_modules`` in setup.py, or directly for an in-place build.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-D_GNU_SOURCE", "-fvisibility=hidden"]


def ffibuilder(name: str, modules: Sequence[str], *, libraries: Sequence[str] = (),
               include_dirs: Sequence[str] = ()) -> FFI:
    """The FFI of extension ``name`` (``"layerfs._native"``) over ``modules`` of the core, in
    that order (``"error"`` first: the others' cdefs use its struct)."""
    ffi = FFI()
    headers = []
    for m in modules:
        cdef = CSRC / "cdef" / f"{m}.cdef"
        if cdef.exists():
            ffi.cdef(cdef.read_text())
        if (CSRC / "include" / f"lfs_{m}.h").exists():
            headers.append(f"lfs_{m}.h")
    ffi.set_source(
        name,
        "\n".join(f'#include "{h}"' for h in headers),
        sources=[f"csrc/lib/{m}.c" for m in modules],
        include_dirs=[str(CSRC / "include"), *include_dirs],
        extra_compile_args=CFLAGS,
        libraries=list(libraries),
    )
    return ffi


def build_in_place(ffi: FFI, package: str) -> None:
    """Compile ``ffi`` into ``<package>/_native.abi3.so`` in the checkout: the name ``pip
    install`` gives it (cffi builds for the limited API), since a copy under this
    interpreter's own suffix would be imported first and shadow every later pip build."""
    os.chdir(ROOT)
    built = ffi.compile(tmpdir=str(ROOT), verbose=False)
    target = ROOT / package / "_native.abi3.so"
    if pathlib.Path(built).resolve() != target:
        os.replace(built, target)
