"""pip's failures as typed errors that say why (edged.projects.pip.classify), from real pip
runs against local inputs (no index: ``--no-index``), and the workspace plan.

Regression: a version that does not exist ended ``edged rollout`` with a raw
``CalledProcessError`` traceback."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from edged.projects import errors
from edged.projects.image import plan_workspace
from edged.projects.pip import Dist, classify, installed, pip


def _project(root: Path, name: str, more: str = "",
             files: dict[str, str] | None = None) -> Path:
    """A setuptools project (built without isolation: the test interpreter's setuptools)."""
    pytest.importorskip("setuptools")
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "1.0"
        """) + more)
    for fname, text in (files or {}).items():
        (root / fname).write_text(textwrap.dedent(text))
    return root


def test_no_such_release_names_versions(tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    with pytest.raises(errors.NoSuchRelease) as e:
        pip(["download", "--no-index", "--find-links", str(links), "--no-deps", "-d",
             str(tmp_path / "dl"), "nosuchproject==1.0"], what="downloading nosuchproject==1.0",
            project="NoSuchProject")
    msg = str(e.value)
    assert msg.startswith("downloading nosuchproject==1.0: the package index has no such "
                          "release of NoSuchProject (versions there: none)")
    assert "No matching distribution found for nosuchproject==1.0" in msg  # pip quoted
    assert "Traceback" not in msg and e.value.code == "no_release"


def test_missing_dependency_is_a_dependency_failure(tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    with pytest.raises(errors.DependencyFailed, match="test dependency pretend has no "
                                                       "release"):
        pip(["download", "--no-index", "--find-links", str(links), "--no-deps", "-d",
             str(tmp_path / "dl"), "pretend"], what="resolving", project="packaging")


def test_build_needing_a_compiler(tmp_path: Path) -> None:
    src = _project(tmp_path / "cext", "cext", files={"setup.py": """
        from setuptools import Extension, setup
        setup(ext_modules=[Extension("cext._c", ["c.c"])])
        """, "c.c": "#include <no_such_header_edged.h>\n"})
    with pytest.raises(errors.BuildFailed) as e:
        pip(["wheel", "-q", "--no-index", "--no-build-isolation", "--no-deps", "-w",
             str(tmp_path / "w"), str(src)], what="building cext", project="cext")
    msg = str(e.value)
    assert msg.startswith("building cext: building cext from its sdist failed; its build "
                          "needs a compiler or headers")
    assert "no_such_header_edged.h" in msg


def test_requires_python(tmp_path: Path) -> None:
    src = _project(tmp_path / "future", "future-only", 'requires-python = ">=3.99"\n')
    with pytest.raises(errors.PythonMismatch) as e:
        pip(["install", "--dry-run", "-q", "--ignore-installed", "--no-index",
             "--no-build-isolation", "--no-deps", str(src)], what="resolving future-only",
            project="future-only")
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert "it needs Python >=3.99; the base layer's Python is " + v in str(e.value)


@pytest.mark.parametrize(("output", "cls", "why"), [
    ("ERROR: Cannot install packaging<24 and packaging==24.1 because these package versions "
     "have conflicting dependencies.\nERROR: ResolutionImpossible: for help visit https://pip"
     ".pypa.io/en/latest/topics/dependency-resolution/",
     errors.DependencyFailed, "the requirements conflict (pip names them below)"),
    ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None))"
     " after connection broken by 'NewConnectionError(...: Failed to establish a new "
     "connection: [Errno -3] Temporary failure in name resolution')': /simple/attrs/\n"
     "ERROR: Could not find a version that satisfies the requirement attrs==24.2.0 (from "
     "versions: none)\nERROR: No matching distribution found for attrs==24.2.0",
     errors.IndexUnreachable, "the package index could not be reached"),
    ("  error: subprocess-exited-with-error\n  x Building wheel for lxml (pyproject.toml) did "
     "not run successfully.\n  gcc -pthread ... fatal error: libxml/xmlversion.h: No such "
     "file\nERROR: Failed to build installable wheels for some pyproject.toml based projects"
     " (lxml)", errors.DependencyFailed, "test dependency lxml failed to build; its build "
                                         "needs a compiler or headers"),
    ("ERROR: something pip has never said", errors.ProjectError, "pip failed"),
])
def test_classify_messages(output: str, cls: type[errors.ProjectError], why: str) -> None:
    e = classify(output, "resolving attrs==24.2.0", "attrs")
    assert type(e) is cls
    assert str(e).startswith(f"resolving attrs==24.2.0: {why}")
    assert "WARNING" not in str(e)  # pip's warnings are not quoted


def test_versions_list_is_shortened() -> None:
    out = ("ERROR: Could not find a version that satisfies the requirement packaging==99 (from "
           "versions: " + ", ".join(f"{i}.0" for i in range(14, 27)) + ")\n"
           "ERROR: No matching distribution found for packaging==99")
    msg = str(classify(out, "downloading", "packaging"))
    assert "(versions there: 19.0, 20.0, 21.0, 22.0, 23.0, 24.0, 25.0, 26.0 and 5 older)" in msg


def test_plan_keeps_project_and_differing_versions() -> None:
    resolved = [Dist("packaging", "24.1", True), Dist("pytest", "9.2.0", True),
                Dist("pluggy", "1.7.0"), Dist("pretend", "1.0.9", True),
                Dist("iniconfig", "2.0.0")]
    toolkit = {"pytest": "9.2.0", "pluggy": "1.7.0", "iniconfig": "2.3.1",
               "packaging": "24.1"}
    mine, shared = plan_workspace(resolved, toolkit, "Packaging")
    # the project is installed even at the toolkit's version: it is the code under test
    assert [d.pin for d in mine] == ["packaging==24.1", "pretend==1.0.9", "iniconfig==2.0.0"]
    assert [d.pin for d in shared] == ["pytest==9.2.0", "pluggy==1.7.0"]


def test_installed_reads_dist_info(tmp_path: Path) -> None:
    for name, ver in (("Foo_Bar", "1.2"), ("baz", "3")):
        d = tmp_path / f"{name}-{ver}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
    assert installed(tmp_path) == {"foo-bar": "1.2", "baz": "3"}
