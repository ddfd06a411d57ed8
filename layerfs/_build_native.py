"""cffi build script for the private extension ``layerfs._native`` (API mode).

One cdef per C module lives in ``csrc/cdef/<module>.cdef``; every ``csrc/lib/*.c`` is
compiled into the one extension (the internal library). Run by ``pip install .`` through
``cffi_modules`` in setup.py; can also be run directly (``python layerfs/_build_native.py``)
to build in place for development.
"""

from __future__ import annotations

import pathlib

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

ffibuilder = FFI()

for cdef in sorted((CSRC / "cdef").glob("*.cdef")):
    ffibuilder.cdef(cdef.read_text())

_headers = sorted((CSRC / "include").glob("lfs_*.h"))
_sources = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "lib").glob("*.c"))

ffibuilder.set_source(
    "layerfs._native",
    "\n".join(f'#include "{h.name}"' for h in _headers),
    sources=_sources,
    include_dirs=[str(CSRC / "include")],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-D_GNU_SOURCE",
                        "-fvisibility=hidden"],
    libraries=[],
)

if __name__ == "__main__":
    import os

    os.chdir(ROOT)
    ffibuilder.compile(tmpdir=str(ROOT), verbose=False)
