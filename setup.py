"""Build glue: setuptools needs ``cffi_modules`` passed to ``setup()``.

Everything else lives in pyproject.toml. The C core is compiled by the cffi build
script ``layerfs/_build_native.py`` into the private extension ``layerfs._native``.
The small executables (sbx-init, edged-spawner) are built by ``csrc/build_bins.py`` into
``edged/_bin/`` during build_py, for both ``pip install .`` and ``pip install -e .``.
"""

import importlib.util
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

_HERE = pathlib.Path(__file__).resolve().parent


class build_py_with_bins(build_py):
    def run(self) -> None:
        super().run()
        spec = importlib.util.spec_from_file_location("build_bins", _HERE / "csrc/build_bins.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out = _HERE / "edged" / "_bin"
        if not self.editable_mode:
            out = pathlib.Path(self.build_lib) / "edged" / "_bin"
        mod.build(out)


setup(
    cffi_modules=["layerfs/_build_native.py:ffibuilder"],
    cmdclass={"build_py": build_py_with_bins},
)
