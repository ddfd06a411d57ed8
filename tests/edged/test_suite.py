"""The pieces of ``edged suite`` around the layers: the table, why a red run failed, a
project that cannot run, the runtime dir it leaves (nothing).

Regressions: the summary column was cut at 60 characters and the columns misaligned as soon
as a sandbox id was longer than 12 characters (they are 18); the cause of a red run showed
only in ``--json``; a version that does not exist ended in a ``CalledProcessError``
traceback; ``/run/edged-rollout-*`` dirs were left behind (the daemon's pid file and policy
cache are files, and only empty dirs were removed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from edged import suite as rollout
from edged.projects import errors

LONG = ("26854 passed, 6 warnings, 2332 subtests passed, 1 skipped, 3 xfailed in 59.29s "
        "(0:00:59)")


def _outcome(i: int, **kw: object) -> dict[str, object]:
    o = {"id": f"rollout-03b44f32-{i}", "create_s": 0.0471 * (i + 1), "run_s": 4.47 + i * 10,
         "exit_code": 0, "reason": "exited", "passed": 663 * (i + 1), "failed": 0,
         "skipped": 1, "summary": LONG, "cause": ""}
    o.update(kw)
    return o


def test_table_aligned_and_summary_whole() -> None:
    rows = [_outcome(0), _outcome(1, exit_code=None, reason="timeout", passed=0,
                                  summary="started"), _outcome(12)]
    lines = rollout.format_table(rows)
    assert len(lines) == 4 and lines[0].startswith("SANDBOX")
    # every column starts (left-aligned id) or ends (right-aligned numbers) at one offset
    for header in ("CREATE", "RUN", "EXIT", "PASS", "FAIL"):
        end = lines[0].index(header) + len(header)
        for line in lines[1:]:
            assert line[end] == " " and line[end - 1] != " ", (header, lines)
    summary_at = lines[0].index("SUMMARY")
    assert lines[1][summary_at:] == LONG  # not cut
    assert lines[2][summary_at:] == "started"
    assert "timeout" in lines[2] and "rollout-03b44f32-12" in lines[3]


@pytest.mark.parametrize(("stdout", "code", "reason", "want"), [
    # a collection error: pytest -q names the file only; the exception comes from its E line
    ("E   ModuleNotFoundError: No module named 'hypothesis'\n= short test summary info =\n"
     "ERROR tests/test_idna_properties.py\n1 error in 0.30s\n", 2, "exited",
     "pytest exit 2: interrupted (errors during collection): ERROR "
     "tests/test_idna_properties.py | E ModuleNotFoundError: No module named 'hypothesis'"),
    ("FAILED t.py::a - AssertionError: x\nFAILED t.py::b - KeyError\nFAILED t.py::c - E\n"
     "FAILED t.py::d - E\n4 failed in 1s\n", 1, "exited",
     "pytest exit 1: tests failed: FAILED t.py::a - AssertionError: x | FAILED t.py::b - "
     "KeyError | FAILED t.py::c - E (+1 more)"),
    ("no tests ran in 0.01s\n", 5, "exited", "pytest exit 5: no tests collected: no tests ran "
                                             "in 0.01s"),
    ("collected 10 items\n", None, "timeout", "timed out: collected 10 items"),
    ("", None, "oom", "killed: out of memory"),
])
def test_explain(stdout: str, code: int | None, reason: str, want: str) -> None:
    assert rollout.explain(stdout, "", code, reason) == want


def test_human_report_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    cause = "pytest exit 2: interrupted (errors during collection): ERROR tests/t.py"
    outs = [_outcome(0, exit_code=2, passed=0, failed=1, cause=cause),
            _outcome(1, exit_code=2, passed=0, failed=1, cause=cause), _outcome(2)]
    rollout.print_human({"outcomes": outs, "project": "p==1", "succeeded": 1, "sandboxes": 3,
                         "tests_passed": 1989, "tests_failed": 2,
                         "create_s": {"p50": 0.05, "p99": 0.1}, "run_s": {"p50": 4.0},
                         "wall_s": 9.0})
    out = capsys.readouterr().out
    assert f"why rollout-03b44f32-0, rollout-03b44f32-1: {cause}\n" in out
    assert out.count("why ") == 1
    assert "p==1: 1/3 sandboxes green" in out


@pytest.mark.parametrize(("exc", "code"), [
    (errors.NoSuchRelease("downloading the sdist of packaging==99: the package index has no "
                          "such release of packaging (versions there: 26.3, 26.4)"),
     "no_release"),
    (errors.NoTests("the sdist of tomli 2.5.0 carries no tests"), "no_tests"),
])
def test_project_that_cannot_run(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str],
                                 exc: errors.ProjectError, code: str) -> None:
    def fail(*_a: object, **_kw: object) -> None:
        raise exc

    monkeypatch.setattr(rollout, "build_project_image", fail)
    assert rollout.main(["--project", "x==1"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"edged suite: x==1: tests cannot run ({code}): {exc.message}\n")
    assert "Traceback" not in err
    assert rollout.main(["--project", "x==1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out) == {
        "project": "x==1", "error": {"code": code, "message": exc.message}}


def test_runtime_dir_removed_with_files(tmp_path: Path) -> None:
    rt = tmp_path / "edged-rollout-x"
    (rt / "policies").mkdir(parents=True)
    (rt / "policies" / "ab.landlock").write_bytes(b"\0" * 10)
    (rt / "edged.pid").write_text("123\n")
    (rt / "layers").mkdir()
    assert rollout.remove_runtime_dir(str(rt))
    assert not rt.exists()
    assert rollout.remove_runtime_dir(str(rt))  # already gone: fine


@pytest.mark.root
@pytest.mark.mount
def test_runtime_dir_kept_while_mounted(tmp_path: Path) -> None:
    rt = tmp_path / "edged rollout"  # a space: mountinfo escapes it as \040
    mnt = rt / "layers" / "sha256:x"
    mnt.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "edged-rollout-test", str(mnt)],
                   check=True)
    try:
        (mnt / "data").write_text("inside a mount")
        (rt / "edged.pid").write_text("1\n")
        assert not rollout.remove_runtime_dir(str(rt))
        assert (mnt / "data").read_text() == "inside a mount"
        assert (rt / "edged.pid").exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert rollout.remove_runtime_dir(str(rt)) and not rt.exists()
    assert not os.path.exists(mnt)
