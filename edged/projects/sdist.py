"""A project's source release: fetched from the package index as an sdist (its tests ship
there, not in wheels), unpacked safely, its core metadata read."""

from __future__ import annotations

import logging
import os
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.metadata import parse_email
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from edged.projects.errors import BadRequirement, NoSdist, NoTests, ProjectError
from edged.projects.pip import pip

log = logging.getLogger("edged.projects")

#: Directories never searched for tests (vendored code, build leftovers).
_SKIP_DIRS = {".git", ".tox", ".nox", "build", "dist", "node_modules", "__pycache__"}


@dataclass(frozen=True)
class Sdist:
    """An unpacked sdist. ``name``: canonical project name; ``version``: its version;
    ``root``: the unpacked top directory; ``archive``: the downloaded file;
    ``provides_extra``: the extras its PKG-INFO declares, or None when PKG-INFO cannot be
    trusted for them (metadata older than 2.2, or the field marked ``Dynamic``: the build
    backend must be asked)."""

    name: str
    version: str
    root: Path
    archive: Path
    provides_extra: tuple[str, ...] | None


def parse_requirement(requirement: str) -> Requirement:
    """The project requirement (``NAME``, ``NAME==VERSION``, any PEP 508 specifier). Raises
    :class:`BadRequirement` for anything else (a URL, extras, markers: the project comes
    from the index as an sdist)."""
    try:
        req = Requirement(requirement)
    except InvalidRequirement as e:
        raise BadRequirement(f"{requirement!r} is not a requirement: {e}") from None
    if req.url or req.extras or req.marker:
        raise BadRequirement(f"{requirement!r}: give NAME or NAME==VERSION (no URL, extras "
                             "or markers)")
    return req


def fetch_sdist(requirement: str, dest: Path) -> Sdist:
    """Download ``requirement``'s sdist from the package index into ``dest`` and unpack it.
    Raises :class:`BadRequirement`, :class:`NoSuchRelease` (no such release),
    :class:`NoSdist` (the release has only wheels), :class:`ProjectError` (an archive that
    is not one sdist directory)."""
    req = parse_requirement(requirement)
    dl = dest / "dl"
    try:
        pip(["download", "-q", "--no-deps", "--no-binary", req.name, "-d", str(dl),
             requirement], what=f"downloading the sdist of {requirement}", project=req.name)
    except ProjectError as e:
        if e.code in ("no_release", "dependency_failed") and _has_wheel(requirement,
                                                                         req.name):
            raise NoSdist(f"{requirement} is on the package index only as wheels: there is "
                          "no sdist, so no tests to run") from None
        raise
    archives = [p for p in dl.iterdir() if p.is_file()]
    if len(archives) != 1:
        raise ProjectError(f"downloading {requirement} gave {len(archives)} files, not one")
    root = unpack(archives[0], dest / "src")
    return _read_pkg_info(root, archives[0], req.name)


def _has_wheel(requirement: str, name: str) -> bool:
    """Whether the index has a wheel of ``requirement`` for this Python (a dry run: pip reads
    the wheel's metadata, PEP 658, and downloads no wheel)."""
    try:
        pip(["install", "--dry-run", "-q", "--no-deps", "--ignore-installed", "--only-binary",
             ":all:", requirement], what="probing for wheels", project=name)
    except ProjectError:
        return False
    return True


def unpack(archive: Path, out: Path) -> Path:
    """Unpack an sdist (``.tar.gz``/``.tar.bz2``/``.tar.xz``/``.zip``) into ``out``; returns its
    one top directory. Members that would land outside ``out``, links out of it and device
    files are refused (tarfile's ``data`` filter; zip names checked). Raises
    :class:`ProjectError`."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for n in zf.namelist():
                    target = (out / n).resolve()
                    if not target.is_relative_to(out.resolve()):
                        raise ProjectError(f"{archive.name}: member {n!r} leaves the archive")
                zf.extractall(out)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(out, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
        raise ProjectError(f"{archive.name}: cannot unpack: {e}") from None
    tops = [p for p in out.iterdir()]
    if len(tops) != 1 or not tops[0].is_dir():
        raise ProjectError(f"{archive.name}: an sdist has one top directory, this has "
                           f"{sorted(p.name for p in tops)}")
    return tops[0]


def _read_pkg_info(root: Path, archive: Path, asked: str) -> Sdist:
    pkg_info = root / "PKG-INFO"
    if not pkg_info.is_file():
        raise ProjectError(f"{archive.name}: no PKG-INFO: not an sdist")
    raw, _ = parse_email(pkg_info.read_text(errors="replace"))
    name = canonicalize_name(str(raw.get("name") or asked))
    version = str(raw.get("version") or "")
    dynamic = {d.lower() for d in raw.get("dynamic", [])}
    try:
        reliable = Version(str(raw.get("metadata_version", "1.0"))) >= Version("2.2")
    except InvalidVersion:
        reliable = False
    extras: tuple[str, ...] | None = None
    if reliable and "provides-extra" not in dynamic:
        extras = tuple(raw.get("provides_extra", []))
    return Sdist(name, version, root, archive, extras)


def test_files(root: Path, limit: int = 1) -> list[Path]:
    """Up to ``limit`` test files under ``root``: pytest's default patterns (``test_*.py``,
    ``*_test.py``) and unittest-style ``test.py``/``tests.py``."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py") and (f.startswith("test_") or f.endswith("_test.py")
                                      or f in ("test.py", "tests.py")):
                found.append(Path(dirpath) / f)
                if len(found) >= limit:
                    return found
    return found


test_files.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def require_tests(sdist: Sdist) -> None:
    """Raise :class:`NoTests` when the sdist carries no test file (:func:`test_files`)."""
    if not test_files(sdist.root):
        raise NoTests(f"the sdist of {sdist.name} {sdist.version} ({sdist.archive.name}) "
                      "carries no tests (no test_*.py, *_test.py, test.py or tests.py): "
                      "nothing to run")
