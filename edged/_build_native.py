"""cffi build script for the private extension ``edged._native``: the C core's confinement
(Landlock, capabilities, seccomp install and notifications: ``confine``), the seccomp
profile compiler (``seccomp``, libseccomp) and memory advice over a process's mappings
(``memory``). The module list and the build are in ``csrc/cffi_build.py``. Run by ``pip
install .`` through ``cffi_modules`` in setup.py, or directly (``python
edged/_build_native.py``) to build in place for development.
"""

from __future__ import annotations

import importlib.util
import pathlib

_CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
_spec = importlib.util.spec_from_file_location("cffi_build", _CSRC / "cffi_build.py")
assert _spec and _spec.loader
cffi_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cffi_build)

#: The core's modules in edged._native.
MODULES = ("error", "confine", "seccomp", "memory")

# libseccomp compiles seccomp profiles to BPF (csrc/lib/seccomp.c).
ffibuilder = cffi_build.ffibuilder("edged._native", MODULES, libraries=["seccomp"])

if __name__ == "__main__":
    cffi_build.build_in_place(ffibuilder, "edged")
