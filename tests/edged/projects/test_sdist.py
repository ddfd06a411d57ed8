"""An sdist unpacked and read (edged.projects.sdist): the requirement checked, members that
escape refused, PKG-INFO trusted for extras only where the metadata spec allows, and an
sdist without tests told apart from a failing run."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from edged.projects import errors
from edged.projects.sdist import (
    _read_pkg_info,
    parse_requirement,
    require_tests,
    test_files,
    unpack,
)


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("req", ["packaging==24.1", "attrs", "six>=1.16,<2"])
def test_requirements_accepted(req: str) -> None:
    assert parse_requirement(req).name


@pytest.mark.parametrize("req", ["", "packaging===", "attrs[tests]==24.2.0",
                                 "x @ https://example.invalid/x.tar.gz",
                                 "six; python_version > '3'", "../local/dir"])
def test_requirements_refused(req: str) -> None:
    with pytest.raises(errors.BadRequirement) as e:
        parse_requirement(req)
    assert e.value.code == "bad_requirement"


def test_unpack_one_top_dir(tmp_path: Path) -> None:
    a = _tar(tmp_path / "p-1.tar.gz", {"p-1/PKG-INFO": b"Name: p\n", "p-1/t/test_a.py": b""})
    top = unpack(a, tmp_path / "out")
    assert top == tmp_path / "out" / "p-1" and (top / "t" / "test_a.py").is_file()


def test_unpack_refuses_escapes(tmp_path: Path) -> None:
    a = _tar(tmp_path / "bad.tar.gz", {"p-1/../../evil": b"x"})
    with pytest.raises(errors.ProjectError, match="cannot unpack"):
        unpack(a, tmp_path / "out")
    assert not (tmp_path / "evil").exists()
    link = tmp_path / "link.tar.gz"
    with tarfile.open(link, "w:gz") as tf:
        info = tarfile.TarInfo("p-1/etc")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc"
        tf.addfile(info)
    with pytest.raises(errors.ProjectError, match="cannot unpack"):
        unpack(link, tmp_path / "out2")


def test_unpack_zip_escape_and_two_tops(tmp_path: Path) -> None:
    z = tmp_path / "p.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("../evil", "x")
    with pytest.raises(errors.ProjectError, match="leaves the archive"):
        unpack(z, tmp_path / "out")
    a = _tar(tmp_path / "two.tar.gz", {"a/x": b"", "b/y": b""})
    with pytest.raises(errors.ProjectError, match="one top directory"):
        unpack(a, tmp_path / "out2")


@pytest.mark.parametrize(("pkg_info", "extras"), [
    # attrs 24.2.0: metadata 2.3, extras listed: trusted
    ("Metadata-Version: 2.3\nName: attrs\nVersion: 24.2.0\nProvides-Extra: tests\n"
     "Provides-Extra: dev\n", ("tests", "dev")),
    # packaging 24.1: metadata 2.1: not guaranteed to match the built metadata
    ("Metadata-Version: 2.1\nName: packaging\nVersion: 24.1\n", None),
    ("Metadata-Version: 2.4\nName: x\nVersion: 1\nDynamic: Provides-Extra\n", None),
    ("Metadata-Version: 2.4\nName: x\nVersion: 1\nDynamic: license-file\n", ()),
])
def test_pkg_info_extras_trusted_only_when_static(tmp_path: Path, pkg_info: str,
                                                  extras: tuple[str, ...] | None) -> None:
    (tmp_path / "PKG-INFO").write_text(pkg_info)
    s = _read_pkg_info(tmp_path, tmp_path / "x.tar.gz", "asked")
    assert s.provides_extra == extras
    assert s.version and s.name == s.name.lower()


def test_no_pkg_info(tmp_path: Path) -> None:
    with pytest.raises(errors.ProjectError, match="no PKG-INFO"):
        _read_pkg_info(tmp_path, tmp_path / "x.tar.gz", "x")


def test_tests_found_or_refused(tmp_path: Path) -> None:
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: tomli\nVersion: 2.5.0\n")
    (tmp_path / "src" / "tomli").mkdir(parents=True)
    (tmp_path / "src" / "tomli" / "__init__.py").write_text("")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "test_leftover.py").write_text("")  # build leftovers don't count
    sdist = _read_pkg_info(tmp_path, tmp_path / "tomli-2.5.0.tar.gz", "tomli")
    assert test_files(tmp_path) == []
    with pytest.raises(errors.NoTests, match=r"tomli 2.5.0 \(tomli-2.5.0.tar.gz\) carries no "
                                             "tests"):
        require_tests(sdist)
    for name in ("test_six.py", "tests/unit/foo_test.py", "tests.py"):
        p = tmp_path / "x" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    assert len(test_files(tmp_path, limit=10)) == 3
    require_tests(sdist)
