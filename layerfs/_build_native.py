"""cffi build script for the private extension ``layerfs._native``: the C core's EROFS
writer, directory scanner and lazy layer server (libfuse3). Confinement is not in it (that
is ``edged._native``), so layerfs builds, imports and makes layers on a host without
libseccomp (an image-build host). The module list and the build are in ``csrc/cffi_build.py``.
Run by ``pip install .`` through ``cffi_modules`` in setup.py, or directly (``python
layerfs/_build_native.py``) to build in place for development.
"""

from __future__ import annotations

import pathlib
import runpy
import shlex
import subprocess

# csrc/ is no package: its helper is loaded by path (cffi_modules runs this file the same way)
_build = runpy.run_path(str(pathlib.Path(__file__).resolve().parent.parent / "csrc/cffi_build.py"))

#: The core's modules in layerfs._native.
MODULES = ("error", "crc32c", "writer", "scan", "lazy")


def _pkg_config(*args: str) -> list[str]:
    return shlex.split(subprocess.run(["pkg-config", *args], check=True,
                                      capture_output=True, text=True).stdout)


# libfuse3 (low-level API) for the lazy layer file server, csrc/lib/lazy.c.
_FUSE_CFLAGS = _pkg_config("--cflags", "fuse3")
_FUSE_LIBS = [f[2:] for f in _pkg_config("--libs", "fuse3") if f.startswith("-l")]

ffibuilder = _build["ffibuilder"](
    "layerfs._native", MODULES, libraries=_FUSE_LIBS,
    include_dirs=[f[2:] for f in _FUSE_CFLAGS if f.startswith("-I")])

if __name__ == "__main__":
    _build["build_in_place"](ffibuilder, "layerfs")
