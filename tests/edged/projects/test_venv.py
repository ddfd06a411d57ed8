"""The path order of a test run (edged.projects.venv): the project's venv before the toolkit,
in every process the venv's Python starts, whatever their environment.

Regression: the rollout put the toolkit on PYTHONPATH only, ahead of everything; pytest's own
``packaging`` (26.x) shadowed ``packaging==24.1`` under test, ``src/`` layouts were not on the
path at all, and a tool that resets PYTHONPATH for its subprocess (pytest-mypy-plugins runs
mypy so) lost every dependency. The venv is built here with host paths standing in for the
sandbox's and run with this machine's Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from edged.projects.venv import TOOLKIT_PTH, adopt_scripts, fix_shebangs, make_venv

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
BASE_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))

PROBE = ("import json, sys, packaging, onlytk, json as stdlib_json; print(json.dumps("
         "[packaging.VERSION, onlytk.WHERE, stdlib_json.__file__, sys.prefix]))")


def _pkg(site: Path, name: str, body: str) -> None:
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(body)


def _env(tmp_path: Path) -> tuple[Path, Path]:
    toolkit = tmp_path / "opt-toolkit"
    _pkg(toolkit, "packaging", "VERSION = 'toolkit 26'\n")
    _pkg(toolkit, "onlytk", "WHERE = 'toolkit'\n")
    _pkg(toolkit, "json", "raise ImportError('a toolkit json shadowed the stdlib')\n")
    venv = tmp_path / "work-venv"
    site = make_venv(venv, prefix=str(venv), python=BASE_PYTHON, pyver=PYVER,
                     after=[str(toolkit)])
    _pkg(site, "packaging", "VERSION = 'project 24.1'\n")
    return venv, site


def test_project_version_wins_and_toolkit_fills_in(tmp_path: Path) -> None:
    venv, site = _env(tmp_path)
    assert (site / TOOLKIT_PTH).read_text() == f"{tmp_path / 'opt-toolkit'}\n"
    clean = {"PATH": f"{venv}/bin:{tmp_path / 'opt-toolkit' / 'bin'}:/usr/bin:/bin"}
    # a toolkit script (how pytest runs): `#!/usr/bin/env python3` finds the venv's first
    script = tmp_path / "opt-toolkit" / "bin" / "probe"
    script.parent.mkdir()
    script.write_text(f"#!/host/venv/bin/python\n{PROBE}\n")
    fix_shebangs(script.parent, "/usr/bin/env python3")
    script.chmod(0o755)
    for argv, env in (
        ([str(venv / "bin" / "python"), "-c", PROBE], clean),
        (["python3", "-c", PROBE], clean),  # a shell's `python3` in the venv's PATH
        (["probe"], clean),
        # a tool that gives its subprocess a PYTHONPATH of its own (pytest-mypy-plugins)
        ([str(venv / "bin" / "python"), "-c", PROBE], {**clean, "PYTHONPATH": "/nonexistent"}),
    ):
        out = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True,
                                        check=True, cwd=tmp_path).stdout)
        assert out[0] == "project 24.1", out
        assert out[1] == "toolkit"
        assert not out[2].startswith(str(tmp_path)), "the stdlib must stay ahead"
        assert out[3] == str(venv)


def test_subprocess_of_venv_python_keeps_the_order(tmp_path: Path) -> None:
    venv, _ = _env(tmp_path)
    nested = ("import subprocess, sys; print(subprocess.run([sys.executable, '-c', "
              f"{PROBE!r}], env={{}}, capture_output=True, text=True).stdout)")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", nested], env={},
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)[:2] == ["project 24.1", "toolkit"]


def test_scripts_adopted_with_sandbox_shebang(tmp_path: Path) -> None:
    venv, site = _env(tmp_path)
    (site / "bin").mkdir()
    (site / "bin" / "pytest").write_text("#!/host/.venv/bin/python3.11\nprint(1)\n")
    (site / "bin" / "python").write_text("#!/host/python\n")  # would clobber the venv's
    (site / "bin" / "data.sh").write_text("#!/bin/sh\necho\n")
    adopt_scripts(site, venv, "/work/.venv/bin/python")
    assert not (site / "bin").exists()
    assert (venv / "bin" / "pytest").read_text() == "#!/work/.venv/bin/python\nprint(1)\n"
    assert (venv / "bin" / "data.sh").read_text() == "#!/bin/sh\necho\n"
    assert os.readlink(venv / "bin" / "python") == BASE_PYTHON
    tk = tmp_path / "tkbin"
    tk.mkdir()
    (tk / "pytest").write_text("#!/host/.venv/bin/python\nx\n")
    fix_shebangs(tk, "/usr/bin/env python3")
    assert (tk / "pytest").read_text() == "#!/usr/bin/env python3\nx\n"
