"""Which test dependencies are read from an sdist (edged.projects.testdeps): the tiers, each
source format, what is skipped and why. The trees mirror what real sdists ship (the
comments name the project each shape comes from)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from edged.projects.testdeps import dependency_group, find_test_deps


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def test_test_extra_from_metadata(tmp_path: Path) -> None:
    # attrs: a "tests" extra; tox.ini's extras are factor-conditional ("tests: tests")
    root = tree(tmp_path, {"tox.ini": """
        [testenv]
        extras =
            tests: tests
            mypy: tests-mypy
        commands = pytest {posargs:-n auto}
        """})
    d = find_test_deps(root, "attrs", ["benchmark", "cov", "dev", "docs", "tests",
                                       "tests_mypy"])
    assert d.extras == ("tests",)
    assert d.requirements == ()
    assert d.sources == ("extra tests",)
    assert any("'tests: tests'" in s and "factor" in s for s in d.skipped)


def test_dependency_groups_with_includes(tmp_path: Path) -> None:
    # pluggy: [dependency-groups] testing = [...]; tox names the group; dev not read
    root = tree(tmp_path, {"pyproject.toml": """
        [dependency-groups]
        dev = ["pre-commit"]
        Testing = ["pytest>=8", {include-group = "cov"}]
        cov = ["coverage[toml]"]
        """, "tox.ini": """
        [testenv]
        dependency_groups=testing
        deps=
          coverage: coverage
          pytestmain: git+https://github.com/pytest-dev/pytest.git@main
        """})
    d = find_test_deps(root, "pluggy", [])
    assert d.requirements == ("pytest>=8", "coverage[toml]")
    assert d.sources == ("dependency group testing",)
    assert "pre-commit" not in d.requirements
    assert sum("factor" in s for s in d.skipped) == 2


def test_dependency_group_cycle_and_bad_entry() -> None:
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        dependency_group({"a": [{"include-group": "b"}], "b": [{"include-group": "a"}]}, "a")
    with pytest.raises(ValueError, match="not valid"):
        dependency_group({"a": [3]}, "a")
    with pytest.raises(KeyError):
        dependency_group({"a": []}, "b")


def test_group_cycle_is_skipped_not_fatal(tmp_path: Path) -> None:
    root = tree(tmp_path, {"pyproject.toml": """
        [dependency-groups]
        test = [{include-group = "test"}]
        """})
    d = find_test_deps(root, "x", [])
    assert d.requirements == () and any("cycle" in s for s in d.skipped)


def test_tox_deps_and_requirements_files(tmp_path: Path) -> None:
    # python-dateutil: deps = -rrequirements-dev.txt; wcwidth: -r file plus a bare name
    root = tree(tmp_path, {"tox.ini": """
        [tox]
        envlist = py3
        [testenv]
        deps = -rrequirements-dev.txt
               setuptools
               {env:EXTRA_DEP}
               -e .
        """, "requirements-dev.txt": """
        # comment
        pytest >= 3.0
        pytest-cov >= 2.0.0 \\
            --hash=sha256:0123
        -r requirements/more.txt
        -c constraints.txt
        """, "requirements/more.txt": """
        freezegun  # inline comment
        hypothesis >= 3.30 ; python_version >= "3"
        -r ../../outside.txt
        """})
    d = find_test_deps(root, "python-dateutil", [])
    assert d.requirements == ("pytest>=3.0", "pytest-cov>=2.0.0", "freezegun",
                              'hypothesis>=3.30; python_version >= "3"', "setuptools")
    assert d.sources == ("tox.ini [testenv] deps",)
    skipped = "\n".join(d.skipped)
    assert "{env:EXTRA_DEP}" in skipped and "'-e .'" in skipped
    assert "-c constraints.txt" in skipped and "outside the sdist" in skipped


def test_setup_cfg_and_pyproject_tox(tmp_path: Path) -> None:
    root = tree(tmp_path / "a", {"setup.cfg": """
        [metadata]
        name = a
        [tox:tox]
        envlist = py3
        [testenv]
        deps = pytest-timeout
        extras = testing
        """})
    d = find_test_deps(root, "a", ["testing"])
    assert d.requirements == ("pytest-timeout",) and d.extras == ("testing",)
    assert d.sources == ("extra testing", "setup.cfg [testenv] deps",
                         "setup.cfg [testenv] extras")
    root = tree(tmp_path / "b", {"pyproject.toml": """
        [tool.tox.env_run_base]
        deps = ["pytest-mock"]
        dependency_groups = ["test"]
        [dependency-groups]
        test = ["pytest"]
        """})
    d = find_test_deps(root, "b", [])
    assert d.requirements == ("pytest", "pytest-mock")
    root = tree(tmp_path / "c", {"pyproject.toml": '''
        [tool.tox]
        legacy_tox_ini = """
        [testenv]
        deps = trustme
        """
        '''})
    assert find_test_deps(root, "c", []).requirements == ("trustme",)


def test_requirements_file_is_tier_two(tmp_path: Path) -> None:
    # packaging: only tests/requirements.txt (its noxfile is not in the sdist)
    files = {"tests/requirements.txt": "coverage[toml]>=5.0.0\npip>=21.1\npretend\n"
                                       "pytest>=6.2.0\n"}
    d = find_test_deps(tree(tmp_path / "a", files), "packaging", [])
    assert d.requirements == ("coverage[toml]>=5.0.0", "pip>=21.1", "pretend", "pytest>=6.2.0")
    assert d.sources == ("tests/requirements.txt",)
    # a tier-one declaration hides it
    d = find_test_deps(tree(tmp_path / "b", {**files, "pyproject.toml": """
        [dependency-groups]
        tests = ["pretend"]
        """}), "packaging", [])
    assert d.requirements == ("pretend",) and d.sources == ("dependency group tests",)


def test_dev_is_the_last_resort(tmp_path: Path) -> None:
    # iniconfig: only a dev group
    root = tree(tmp_path, {"pyproject.toml": """
        [dependency-groups]
        dev = ["pytest>=8.4.2", "pytest-xdist>=3.8"]
        """, "requirements-dev.txt": "ruff\n"})
    d = find_test_deps(root, "iniconfig", ["dev"])
    assert d.extras == ("dev",)
    assert d.requirements == ("pytest>=8.4.2", "pytest-xdist>=3.8")  # not requirements-dev
    assert d.sources == ("extra dev", "dependency group dev")
    # idna: its test tools only in the "all" extra
    d = find_test_deps(tree(tmp_path / "idna", {}), "idna", ["all"])
    assert d.extras == ("all",) and d.sources == ("extra all",)


def test_self_reference_becomes_extra(tmp_path: Path) -> None:
    root = tree(tmp_path, {"pyproject.toml": """
        [dependency-groups]
        test = ["My_Project[tests-extra]", "pytest", "other @ https://example.invalid/o.whl"]
        """})
    d = find_test_deps(root, "my-project", ["tests_extra"])
    assert d.extras == ("tests-extra",)
    assert d.requirements == ("pytest",)
    assert any("direct URL" in s for s in d.skipped)


def test_unknown_extra_is_dropped(tmp_path: Path) -> None:
    root = tree(tmp_path, {"tox.ini": "[testenv]\nextras = testing\n"})
    d = find_test_deps(root, "x", [])
    assert d.extras == () and any("not provided" in s for s in d.skipped)


def test_nothing_declared(tmp_path: Path) -> None:
    # six: no extras, groups, tox or requirements file: pytest alone (the toolkit's)
    root = tree(tmp_path, {"setup.py": "from setuptools import setup\nsetup()\n",
                           "test_six.py": ""})
    d = find_test_deps(root, "six", [])
    assert (d.extras, d.requirements, d.sources) == ((), (), ())


def test_malformed_files_do_not_raise(tmp_path: Path) -> None:
    root = tree(tmp_path, {"pyproject.toml": "not toml [", "tox.ini": "[testenv\nx",
                           "tests/requirements.txt": "pytest\n!!bad!!\n"})
    d = find_test_deps(root, "x", [])
    assert d.requirements == ("pytest",)
    assert any("not a requirement" in s for s in d.skipped)
