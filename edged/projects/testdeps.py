"""A project's test dependencies, read from what its sdist declares, as its own CI would.

What is read, in tiers; a tier is read only when the ones before it gave nothing:

1. **Declared for tests**: the project's extras named ``test``, ``tests`` or ``testing`` (from
   its metadata, names compared per PEP 685); its dependency groups (PEP 735,
   ``[dependency-groups]`` in ``pyproject.toml``, ``{include-group = ...}`` expanded) of those
   names; tox's base test environment (``[testenv]`` of ``tox.ini``, of ``setup.cfg`` when it
   has ``[tox:tox]``, or of ``pyproject.toml``'s ``tool.tox.legacy_tox_ini``; or
   ``tool.tox.env_run_base``): its ``deps`` (requirements and ``-r`` files), ``extras`` and
   ``dependency_groups``.
2. **Requirements files named for tests**: :data:`TEST_FILES`.
3. **Development sets**: the extras and dependency groups named ``dev`` or ``all`` (idna
   declares its test tools only in ``all``). Requirements files for development
   (``requirements-dev.txt``...) are not read unless tox names them: they carry linters, docs
   and release tools (more-itertools 10.5.0's pulled in 70 distributions for a suite that
   needs none).

Only simple declarations are taken: tox lines with a factor condition (``py38: x``) or a
substitution (``{...}``), direct URL requirements (``x @ git+https://...``), editable or path
installs (``-e .``, ``.``) and index options are skipped, each recorded in
:attr:`TestDeps.skipped`. A requirement naming the project itself (``attrs[tests]`` inside
the ``dev`` extra, ``-e .[test]``) becomes an extra of the project. ``noxfile.py`` is not read
(its sessions are code). pytest itself is not added here: the toolkit provides it.
"""

from __future__ import annotations

import configparser
import re
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

#: Names of extras and dependency groups that declare test dependencies (tier 1).
TEST_NAMES = ("test", "tests", "testing")
#: Requirements files named for tests, relative to the sdist's top (tier 2).
TEST_FILES = ("tests/requirements.txt", "testing/requirements.txt", "test-requirements.txt",
              "requirements-test.txt", "requirements-tests.txt", "requirements_test.txt",
              "requirements/test.txt", "requirements/tests.txt", "requirements/testing.txt")
#: Development sets, the last resort (tier 3).
DEV_NAMES = ("dev", "all")

_FACTOR = re.compile(r"^[\w{}.,!-]+:\s")


@dataclass(frozen=True)
class TestDeps:
    """Test dependencies of one project. ``extras``: the project's own extras to install it
    with (canonical names); ``requirements``: PEP 508 strings for other distributions, in the
    order found, without duplicates; ``sources``: where they came from, for people
    (``"extra tests"``, ``"tox.ini [testenv] deps"``, ``"tests/requirements.txt"``);
    ``skipped``: declarations not taken, each with the reason."""

    __test__ = False  # not a pytest test class despite the name

    extras: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


@dataclass
class _Collect:
    project: str
    root: Path
    extras: list[str] = field(default_factory=list)
    requirements: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def requirement(self, text: str, where: str) -> bool:
        """Take one requirement string; False if it was skipped."""
        try:
            req = Requirement(text)
        except InvalidRequirement:
            self.skipped.append(f"{where}: {text!r} (not a requirement)")
            return False
        if req.url:
            self.skipped.append(f"{where}: {text!r} (direct URL)")
            return False
        if canonicalize_name(req.name) == self.project:
            self.extra_names(req.extras)
            return True
        if str(req) not in self.requirements:
            self.requirements.append(str(req))
        return True

    def extra_names(self, names: Iterable[str]) -> None:
        for n in names:
            c = canonicalize_name(n)
            if c not in self.extras:
                self.extras.append(c)

    def source(self, label: str, took: bool) -> None:
        if took and label not in self.sources:
            self.sources.append(label)

    def empty(self) -> bool:
        return not self.extras and not self.requirements

    def requirements_file(self, path: Path, label: str, seen: set[Path] | None = None) -> bool:
        """Take every requirement of a pip requirements file (``-r`` followed inside the
        sdist); True if any was taken."""
        seen = set() if seen is None else seen
        real = path.resolve()
        if not real.is_relative_to(self.root.resolve()):
            self.skipped.append(f"{label}: outside the sdist")
            return False
        if real in seen or not real.is_file():
            return False
        seen.add(real)
        took = False
        for line in _logical_lines(real.read_text(errors="replace")):
            inc = _include(line)
            if inc is not None:
                took |= self.requirements_file(real.parent / inc, _rel(real.parent / inc,
                                                                       self.root), seen)
            elif line.startswith("-") or _is_path(line):
                self.skipped.append(f"{label}: {line!r} (option or path)")
            else:
                took |= self.requirement(_strip_hashes(line), label)
        return took


def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(p)


def _logical_lines(text: str) -> Iterator[str]:
    """Lines of a requirements file: continuations joined, comments and blanks dropped."""
    for raw in re.sub(r"\\\n", "", text).splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if line:
            yield line


def _include(line: str) -> str | None:
    """The file named by ``-r FILE`` / ``-rFILE`` / ``--requirement[=]FILE``, else None."""
    m = re.match(r"^(?:-r\s*|--requirement(?:=|\s+))(\S+)$", line)
    return m.group(1) if m else None


def _is_path(line: str) -> bool:
    return line.startswith((".", "/", "~")) or "://" in line.split(";")[0].split(" @ ")[0]


def _strip_hashes(line: str) -> str:
    return re.sub(r"\s--hash[=\s]\S+", "", line).strip()


def _load_pyproject(root: Path) -> dict[str, Any]:
    p = root / "pyproject.toml"
    if not p.is_file():
        return {}
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def dependency_group(groups: dict[str, Any], name: str) -> list[str]:
    """The requirement strings of PEP 735 group ``name`` (``include-group`` entries expanded,
    names compared normalized). Raises KeyError for a group that does not exist, ValueError
    for a cycle or an entry that is neither a string nor an include."""
    by_name = {canonicalize_name(k): v for k, v in groups.items()}

    def expand(n: str, stack: tuple[str, ...]) -> list[str]:
        c = canonicalize_name(n)
        if c in stack:
            raise ValueError(f"dependency group cycle: {' -> '.join((*stack, c))}")
        out: list[str] = []
        for item in by_name[c]:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, dict) and isinstance(item.get("include-group"), str):
                out += expand(item["include-group"], (*stack, c))
            else:
                raise ValueError(f"dependency group {n!r}: entry {item!r} is not valid")
        return out

    return expand(name, ())


def _tox_testenv(root: Path, pyproject: dict[str, Any]) -> tuple[str, dict[str, list[str]]]:
    """(label, {"deps": [...], "extras": [...], "dependency_groups": [...]}) of tox's base
    test environment, or ("", {}) when the project has none we read."""
    tox = pyproject.get("tool", {}).get("tox", {})
    if isinstance(tox, dict) and isinstance(tox.get("env_run_base"), dict):
        base = tox["env_run_base"]
        keys = {k: [str(x) for x in base.get(k, []) if isinstance(x, str)]
                for k in ("deps", "extras", "dependency_groups")}
        return "pyproject.toml [tool.tox.env_run_base]", keys
    candidates: list[tuple[str, str]] = []
    if (root / "tox.ini").is_file():
        candidates.append(("tox.ini", (root / "tox.ini").read_text(errors="replace")))
    if isinstance(tox, dict) and isinstance(tox.get("legacy_tox_ini"), str):
        candidates.append(("pyproject.toml legacy_tox_ini", tox["legacy_tox_ini"]))
    if (root / "setup.cfg").is_file():
        text = (root / "setup.cfg").read_text(errors="replace")
        if "[tox:tox]" in text:
            candidates.append(("setup.cfg", text))
    for label, text in candidates:
        cp = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            cp.read_string(text)
        except configparser.Error:
            continue
        if cp.has_section("testenv"):
            sec = cp["testenv"]
            return f"{label} [testenv]", {
                "deps": [x.strip() for x in sec.get("deps", "").splitlines() if x.strip()],
                "extras": [x.strip() for x in re.split(r"[,\n]", sec.get("extras", ""))
                           if x.strip()],
                "dependency_groups": [x.strip() for x in
                                      re.split(r"[,\n]", sec.get("dependency_groups", ""))
                                      if x.strip()],
            }
    return "", {}


def _groups(c: _Collect, pyproject: dict[str, Any], names: Iterable[str], label: str) -> None:
    groups = pyproject.get("dependency-groups")
    if not isinstance(groups, dict):
        return
    have = {canonicalize_name(k) for k in groups}
    for name in names:
        if canonicalize_name(name) not in have:
            continue
        try:
            reqs = dependency_group(groups, name)
        except (KeyError, ValueError) as e:
            c.skipped.append(f"{label} {name}: {e}")
            continue
        took = False
        for r in reqs:
            took |= c.requirement(r, f"{label} {name}")
        c.source(f"{label} {name}", took)


def _tox(c: _Collect, pyproject: dict[str, Any]) -> None:
    label, env = _tox_testenv(c.root, pyproject)
    if not label:
        return
    took = False
    for line in env.get("deps", []):
        inc = _include(line)
        if line.startswith("#"):
            continue
        if _FACTOR.match(line) or "{" in line:
            c.skipped.append(f"{label} deps: {line!r} (factor condition or substitution)")
        elif inc is not None:
            took |= c.requirements_file(c.root / inc, _rel(c.root / inc, c.root))
        elif line.startswith("-") or _is_path(line):
            c.skipped.append(f"{label} deps: {line!r} (option or path)")
        else:
            took |= c.requirement(line, f"{label} deps")
    c.source(f"{label} deps", took)
    plain = [x for x in env.get("extras", []) if ":" not in x and "{" not in x]
    for x in env.get("extras", []):
        if x not in plain:
            c.skipped.append(f"{label} extras: {x!r} (factor condition or substitution)")
    if plain:
        c.extra_names(plain)
        c.source(f"{label} extras", True)
    _groups(c, pyproject, [x for x in env.get("dependency_groups", []) if ":" not in x],
            "dependency group")


def find_test_deps(root: Path, project: str, provides_extra: Iterable[str]) -> TestDeps:
    """The test dependencies of the project whose unpacked sdist is ``root`` (the tiers of
    this module's docstring). ``project``: its name; ``provides_extra``: the extras its
    metadata declares. Reads files only; raises nothing for a malformed declaration (it is
    recorded in ``skipped``)."""
    c = _Collect(canonicalize_name(project), root)
    pyproject = _load_pyproject(root)
    extras = {canonicalize_name(x) for x in provides_extra}

    def extras_named(names: Iterable[str]) -> None:
        for n in names:
            if canonicalize_name(n) in extras:
                c.extra_names([n])
                c.source(f"extra {canonicalize_name(n)}", True)

    extras_named(TEST_NAMES)
    _groups(c, pyproject, TEST_NAMES, "dependency group")
    _tox(c, pyproject)
    if c.empty():
        for f in TEST_FILES:
            c.source(f, c.requirements_file(root / f, f))
    if c.empty():
        extras_named(DEV_NAMES)
        _groups(c, pyproject, DEV_NAMES, "dependency group")
    unknown = [x for x in c.extras if x not in extras]
    for x in unknown:  # tox or a self-reference named an extra the metadata does not have
        c.skipped.append(f"extra {x!r}: not provided by the project")
    return TestDeps(tuple(x for x in c.extras if x in extras), tuple(c.requirements),
                    tuple(c.sources), tuple(c.skipped))
