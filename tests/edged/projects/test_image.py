"""The image's settings that do not need the index: the base's Python checked against the one
running pip, and the environment of a test run."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

from edged.projects import errors
from edged.projects.image import base_python, check_python, sandbox_env, test_argv

HOST = f"{sys.version_info.major}.{sys.version_info.minor}"


def _rootfs_tar(path: Path, *versions: str) -> str:
    with tarfile.open(path, "w") as tf:
        for name in ["./etc/hostname", *(f"./usr/lib/python{v}/os.py" for v in versions),
                     "./usr/lib/python3/dist-packages/x.py"]:
            info = tarfile.TarInfo(name)
            tf.addfile(info, io.BytesIO(b""))
    return str(path)


def test_base_python_from_tar_and_dir(tmp_path: Path) -> None:
    assert base_python(_rootfs_tar(tmp_path / "a.tar", "3.11")) == "3.11"
    assert base_python(_rootfs_tar(tmp_path / "b.tar")) is None
    assert base_python(_rootfs_tar(tmp_path / "c.tar", "3.11", "3.12")) is None
    (tmp_path / "d" / "usr" / "lib" / "python3.13").mkdir(parents=True)
    (tmp_path / "d" / "usr" / "lib" / "python3.13" / "os.py").write_text("")
    assert base_python(str(tmp_path / "d")) == "3.13"


def test_check_python(tmp_path: Path) -> None:
    check_python(_rootfs_tar(tmp_path / "ok.tar", HOST))
    other = "3.9" if HOST != "3.9" else "3.10"
    with pytest.raises(errors.PythonMismatch, match=f"the base rootfs has Python {other}, "
                                                    f"edged runs Python {HOST}"):
        check_python(_rootfs_tar(tmp_path / "other.tar", other))
    with pytest.raises(errors.PythonMismatch, match="no \\(single\\) python3"):
        check_python(_rootfs_tar(tmp_path / "none.tar"))


def test_run_settings() -> None:
    env = sandbox_env()
    assert env["PATH"].split(":")[0] == "/work/.venv/bin" and env["VIRTUAL_ENV"] == "/work/.venv"
    assert "PYTHONPATH" not in env  # the order lives in the venv, not in the environment
    assert env["PATH"].split(":")[1] == "/opt/toolkit/bin"
    assert test_argv(False)[0] == "/opt/toolkit/bin/pytest"
    assert test_argv(True)[0] == "/work/.venv/bin/pytest"
    assert "--color=no" in test_argv(False)  # wcwidth's addopts ask for colours


def test_resolution_pins_the_toolkit_pytest_then_falls_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The project's environment is resolved with the toolkit's exact pytest; a project
    whose test dependencies exclude it (``pytest<8``) is resolved again without the pin."""
    from edged.projects import image
    from edged.projects.pip import Dist
    from edged.projects.sdist import Sdist
    from edged.projects.testdeps import TestDeps

    calls: list[list[str]] = []

    def fake_resolve(reqs: list[str], **_kw: object) -> tuple[list[Dist], dict[str, object]]:
        calls.append(reqs)
        if "pytest==9.2.0" in reqs and "pytest<8" in reqs:
            raise errors.DependencyFailed("the requirements conflict")
        return [Dist("old", "1.0", True), Dist("pytest", "7.4.4")], {}

    monkeypatch.setattr(image, "resolve", fake_resolve)
    sdist = Sdist("old", "1.0", tmp_path, tmp_path / "old-1.0.tar.gz", ("test",))
    deps = TestDeps(("test",), ("pytest<8",), ("extra test",), ())
    with caplog.at_level("INFO", logger="edged.projects"):
        dists, pinned = image._resolve_env(sdist, deps, {"pytest": "9.2.0"}, "old==1.0")
    assert calls == [["old[test]==1.0", "pytest<8", "pytest==9.2.0"],
                     ["old[test]==1.0", "pytest<8", "pytest"]]
    assert not pinned and Dist("pytest", "7.4.4") in dists
    assert "cannot have the toolkit's pytest 9.2.0" in caplog.text
    calls.clear()
    deps = TestDeps((), ("pretend",), ("tests/requirements.txt",), ())
    _, pinned = image._resolve_env(sdist, deps, {"pytest": "9.2.0"}, "old==1.0")
    assert pinned and calls == [["old==1.0", "pretend", "pytest==9.2.0"]]
