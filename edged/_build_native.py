"""cffi build script for the private extension ``edged._native``: the C core's confinement
(Landlock, capabilities, seccomp install and notifications: ``confine``), the seccomp
profile compiler (``seccomp``, libseccomp) and memory advice over a process's mappings
(``memory``). The module list and the build are in ``csrc/cffi_build.py``. Run by ``pip
install .`` through ``cffi_modules`` in setup.py, or directly (``python
edged/_build_native.py``) to build in place for development.
"""

from __future__ import annotations

import pathlib
import runpy

# csrc/ is no package: its helper is loaded by path (cffi_modules runs this file the same way)
_build = runpy.run_path(str(pathlib.Path(__file__).resolve().parent.parent / "csrc/cffi_build.py"))

#: The core's modules in edged._native.
MODULES = ("error", "confine", "seccomp", "memory")

# libseccomp compiles seccomp profiles to BPF (csrc/lib/seccomp.c).
ffibuilder = _build["ffibuilder"]("edged._native", MODULES, libraries=["seccomp"])

if __name__ == "__main__":
    _build["build_in_place"](ffibuilder, "edged")
