"""``edged suite`` against the real package index (``network``): projects whose tests
could not run before, and the reasons given when a project cannot run.

Regressions: ``--project packaging==24.1`` and ``--project attrs==24.2.0`` ended 0/2 green
(pytest's ``packaging`` 26.x in the toolkit shadowed packaging 24.1; attrs' ``src/`` layout
was never on the path, and pytest-mypy-plugins' mypy lost every dependency); a version that
does not exist ended in a traceback; ``/run/edged-rollout-*`` dirs were left behind.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from edged import suite as rollout
from edged.projects import errors
from edged.projects.sdist import fetch_sdist

pytestmark = pytest.mark.network


def _run_dirs() -> set[str]:
    return {p for p in os.listdir("/run") if p.startswith("edged-rollout-")}


def test_version_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = rollout.main(["--project", "packaging==99.0", "--store", str(tmp_path / "store")])
    err = capsys.readouterr().err
    assert code == 2
    assert ("edged suite: packaging==99.0: tests cannot run (no_release): downloading the "
            "sdist of packaging==99.0: the package index has no such release of packaging "
            "(versions there: ") in err
    assert re.search(r"versions there: [^)]* and \d+ older\)", err), err  # the newest 8
    assert re.search(r"from versions: [^)]*\b24\.1\b", err), err  # pip quoted whole
    assert "Traceback" not in err


def test_wheel_only_release(tmp_path: Path) -> None:
    # onnxruntime publishes wheels only (its metadata is read, no wheel is downloaded)
    with pytest.raises(errors.NoSdist, match="only as wheels: there is no sdist"):
        fetch_sdist("onnxruntime", tmp_path)


def test_sdist_without_tests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # tomli 2.x ships its tests in the repository, not in the sdist
    code = rollout.main(["--project", "tomli==2.2.1", "--store", str(tmp_path / "store"),
                         "--json"])
    assert code == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "no_tests"
    assert err["message"].startswith("the sdist of tomli 2.2.1 (tomli-2.2.1.tar.gz) carries "
                                     "no tests")


def _rollout(tmp_path: Path, capsys: pytest.CaptureFixture[str],
             project: str) -> tuple[int, dict[str, object]]:
    before = _run_dirs()
    code = rollout.main(["-n", "2", "--project", project, "--store", str(tmp_path / "store"),
                         "--output-dir", str(tmp_path / "out"), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert _run_dirs() <= before, "runtime dirs left in /run"
    assert str(tmp_path) not in Path("/proc/mounts").read_text()
    return code, rep


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_packaging_24_1_green(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, rep = _rollout(tmp_path, capsys, "packaging==24.1")
    assert code == 0, rep
    assert rep["succeeded"] == 2
    assert rep["workspace_dists"]["packaging"] == "24.1"  # not the toolkit's 26.x
    assert rep["toolkit_dists"]["packaging"] != "24.1"
    assert "pretend" in rep["workspace_dists"]  # from tests/requirements.txt
    assert rep["toolkit_pytest_used"] and "pytest" not in rep["workspace_dists"]
    assert all(o["passed"] > 20000 for o in rep["outcomes"])  # type: ignore[union-attr]


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_attrs_24_2_0_runs_its_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """attrs 24.2.0 runs whole (src/ layout, mypy through pytest-mypy-plugins). What still
    fails is not the layout: TestPipe::test_wrapped_annotation fails on Python 3.11 outside
    any sandbox too (it passes on 3.13), and tests/test_mypy.yml compares mypy's messages
    with those of the mypy of August 2024 (today's mypy words some differently)."""
    code, rep = _rollout(tmp_path, capsys, "attrs==24.2.0")
    assert "attrs" in rep["workspace_dists"] and "mypy" in rep["workspace_dists"]
    assert rep["test_deps"]["extras"] == ["tests"]  # type: ignore[index]
    logs = sorted((tmp_path / "out").glob("*.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert "\nERROR " not in text, "collection errors: the environment is broken"
        assert "No module named" not in text
        failed = re.findall(r"^FAILED (\S+?)(?:\[| - |$)", text, re.M)
        unexplained = [f for f in failed if not f.startswith("tests/test_mypy.yml::")
                       and f != "tests/test_converters.py::TestPipe::test_wrapped_annotation"]
        assert not unexplained, unexplained
    assert all(o["passed"] >= 1300 for o in rep["outcomes"])  # type: ignore[union-attr]
    assert code == (0 if rep["succeeded"] == 2 else 1)
