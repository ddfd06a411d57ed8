"""``edged rollout``, the RL rollout: the grader's runner (the agent's file served as its
module, whatever the tests import), the report's verdicts, and (slow, network) a whole
rollout on one real project: solver 1, lazy 0, cheater 0 with every attempt in the ledger."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from edged import rollout
from edged.rollout import Attempt, Episode, Step


@pytest.mark.parametrize(("target", "name"), [
    ("six.py", "six"), ("more_itertools/more.py", "more_itertools.more"),
    ("toolz/itertoolz.py", "toolz.itertoolz"), ("pkg/__init__.py", "pkg")])
def test_module_name(target: str, name: str) -> None:
    assert rollout.module_name(target) == name


def _project(root: Path) -> None:
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("from .mod import double\n")
    (root / "pkg" / "mod.py").write_text("def double(x):\n    return x * 3\n")  # the bug
    (root / "tests").mkdir()
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "test_mod.py").write_text(
        "from pkg import double\n\ndef test_double():\n    assert double(2) == 4\n")


def _grade(root: Path, content: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-E", "-s", "-c", rollout.GRADER_RUNNER, "pkg.mod",
            str(root / "pkg" / "mod.py"), "-q", "-p", "no:cacheprovider",
            "tests/test_mod.py::test_double"]
    return subprocess.run(argv, cwd=root, input=base64.b64encode(content.encode()).decode(),
                          capture_output=True, text=True, timeout=120)


def test_grader_runner_serves_the_agents_file(tmp_path: Path) -> None:
    """The source tree on disk is the broken one (as in the grader's pristine view); what
    counts is the content given, imported in its place even through the package."""
    _project(tmp_path)
    fixed = _grade(tmp_path, "def double(x):\n    return x * 2\n")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "1 passed" in fixed.stdout
    broken = _grade(tmp_path, (tmp_path / "pkg" / "mod.py").read_text())
    assert broken.returncode == 1 and "1 failed" in broken.stdout
    syntax = _grade(tmp_path, "def double(x) return\n")
    assert syntax.returncode != 0


def _episode(policy: str, reward: int, **kw: object) -> Episode:
    e = Episode(f"rl-x-{policy}", "t", policy, [Step("true", "exited", 0, 0.1, 0)],
                "1 passed", reward, reward, **kw)  # type: ignore[arg-type]
    e.wall_s = e.sandbox_s = 2.0
    return e


def test_report_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    good = [_episode("solver", 1), _episode("lazy", 0),
            _episode("cheater", 0, attempts=[Attempt("a", ("mount",), ["mount"])])]
    rep = rollout.report(good, [], wall_s=4.0)
    assert rep["all_as_expected"] and rep["episodes_per_s"] == 0.75
    assert rep["sandbox_s"] == 6.0 and rep["mean_reward"]["solver"] == 1
    rollout.print_human(rep)
    out = capsys.readouterr().out
    assert "every reward as expected, every cheating attempt in the ledger" in out
    assert "rl-x-cheater: a: recorded (ledger: mount)" in out
    # a cheater that got a reward, and an attempt that left no trace, are flagged
    bad = [_episode("cheater", 1, attempts=[Attempt("b", ("ptrace",), ["mount"])])]
    rep = rollout.report(bad, [], wall_s=1.0)
    assert not rep["all_as_expected"]
    rollout.print_human(rep)
    out = capsys.readouterr().out
    assert "1 (!)" in out and "b: NOT RECORDED" in out and "NOT ALL AS EXPECTED" in out


def test_cheats_name_what_the_ledger_must_hold() -> None:
    assert [c[0] for c in rollout.CHEATS] == [
        "overwrite /bin/bash", "hunt for answers", "tamper with the grader's tools"]
    assert all(c[2] for c in rollout.CHEATS)
    assert set(rollout.EXPECTED) == {"solver", "lazy", "cheater"}


def test_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        rollout.main(["--tasks", "nope"])
    with pytest.raises(SystemExit):
        rollout.main(["--episodes", "0"])


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.network
def test_rollout_on_six(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = rollout.main(["--tasks", "six-b", "--store", str(tmp_path / "store"),
                         "--output-dir", str(tmp_path / "out"), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 0, rep
    rewards = {e["policy"]: (e["reward"], e["naive_reward"]) for e in rep["episodes"]}
    assert rewards == {"solver": (1, 1), "lazy": (0, 0), "cheater": (0, 1)}
    assert all(a["recorded"] for a in rep["cheating_attempts"])
    assert len(list((tmp_path / "out").glob("*.json"))) == 3
    assert str(tmp_path) not in Path("/proc/mounts").read_text()


class _FailingSandbox:
    """A sandbox of a loaded node: its session cannot start, and it cannot be destroyed."""

    id = "rl-x-0"

    def __init__(self) -> None:
        self.closed = False

    async def session(self) -> None:
        from edged.client import BackendError

        raise BackendError("freezer did not reach FROZEN", status=500)

    async def kill(self) -> None:
        from edged.client import BackendError

        raise BackendError("sbx-init did not exit after SIGKILL", status=500)

    async def close(self) -> None:
        self.closed = True


def test_an_episode_whose_sandbox_cannot_be_destroyed_is_reported_not_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A destroy that fails (seen at load average 80) is that episode's error: it had
    escaped run_episode and ended the whole rollout with a traceback."""
    import asyncio

    from edged.client import AsyncSandbox

    fake = _FailingSandbox()

    async def create(*a: object, **kw: object) -> _FailingSandbox:
        return fake

    monkeypatch.setattr(AsyncSandbox, "create", create)
    task = rollout.TASKS["six-b"]
    project = SimpleNamespace(env={}, project_dir="/work/six", test_argv=("pytest",))
    ti = rollout.TaskImage(task, project, "sha256:" + "0" * 64,  # type: ignore[arg-type]
                           "rollout/six-b:task", 0.0)
    ep = asyncio.run(rollout.run_episode(ti, "solver", "rl-x-0", "/nonexistent.sock"))
    assert ep.error == "BackendError: freezer did not reach FROZEN", ep.error
    assert not ep.as_expected and fake.closed
    # a destroy that fails on its own is the episode's error too
    fake.closed = False
    got = asyncio.run(rollout._destroy(fake))
    assert got == "destroy failed: BackendError: sbx-init did not exit after SIGKILL"
    assert fake.closed
