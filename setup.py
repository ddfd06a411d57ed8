"""Build glue: setuptools needs ``cffi_modules`` passed to ``setup()``.

Everything else lives in pyproject.toml. The C core is compiled by the cffi build
script ``layerfs/_build_native.py`` into the private extension ``layerfs._native``.
The small executables (sbx-init, edged-spawner, edged-vmm-jail) are built by
``csrc/build_bins.py`` into ``edged/_bin/`` during build_py, for both ``pip install .``
and ``pip install -e .``.

The policy data stays in the top-level ``profiles/`` (its source of truth, fixed by the project
brief). A wheel gets a copy of it as ``edged/_profiles/``, which
``edged.security.profile.find_profiles_dir`` looks for first; an editable install keeps no
copy and reads the checkout's ``profiles/`` itself, so edits there take effect at once. The
systemd units (``systemd/*.service``) are copied into the wheel as ``edged/_systemd/``.
"""

import importlib.util
import pathlib
import shutil

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
            profiles = pathlib.Path(self.build_lib) / "edged" / "_profiles"
            shutil.rmtree(profiles, ignore_errors=True)  # a stale build/ from an earlier run
            shutil.copytree(_HERE / "profiles", profiles)
            # the units too, so that a node installed from the wheel alone can install them
            unit = pathlib.Path(self.build_lib) / "edged" / "_systemd"
            unit.mkdir(exist_ok=True)
            for f in sorted((_HERE / "systemd").glob("*.service")):
                shutil.copy2(f, unit / f.name)
        mod.build(out)


setup(
    cffi_modules=["layerfs/_build_native.py:ffibuilder", "edged/_build_native.py:ffibuilder"],
    cmdclass={"build_py": build_py_with_bins},
)
