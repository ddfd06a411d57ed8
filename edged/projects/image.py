"""A Python project as an image of three layers that runs its test suite.

- **base**: a Debian rootfs tarball (``mmdebstrap --variant=minbase --include=python3``,
  made if missing), with its own mtimes (Debian's ``.pyc`` are timestamp-based).
- **toolkit** at :data:`TOOLKIT` (``/opt/toolkit``): pytest and its dependencies, installed
  from the index with ``pip --target``; the same layer for every project.
- **workspace**: the project's sdist unpacked at ``/work/<name>`` (its tests), and the
  project's environment, a venv at :data:`PROJECT_ENV` (``/work/.venv``,
  :mod:`edged.projects.venv`): the project itself, built from that sdist and installed as
  its CI would (``pip install``, not the source tree on the path: ``src/`` layouts work),
  with its test dependencies (:mod:`edged.projects.testdeps`). Tests run from the
  project's directory with the toolkit's ``pytest`` script (:func:`test_argv`), under the
  venv's Python; the source tree is not put first on the path (as ``python -m pytest``
  would), so a flat-layout project is tested as built and installed (wcwidth's tests check
  that its compiled extension is loaded, which its source tree does not have).

**Path order.** The venv's site-packages, then the toolkit (a ``.pth`` entry): where both
hold a distribution (pytest's own dependencies: ``packaging``, ``pluggy``, ``iniconfig``...)
the project's version wins, which is what its tests are written against (the project under
test may be one of them). The two cannot disagree silently: the project's environment is
resolved together with the toolkit's exact pytest (``pytest==V``), so its versions of shared
dependencies are ones that pytest accepts; distributions identical to the toolkit's (same
name and version, pytest itself) are left out of the workspace. Only when the project's test
dependencies exclude the toolkit's pytest (``pytest<8``) is it resolved without that pin: its
own pytest is then in the venv and wins (logged, and ``pytest_pinned`` is False).

The host Python that runs pip must be the base layer's (same ``major.minor``): pip picks
wheels and evaluates markers for its own interpreter.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.utils import canonicalize_name

from edged.projects.errors import ProjectError, PythonMismatch
from edged.projects.pip import (
    Dist,
    compile_for_sandbox,
    install_target,
    installed,
    pip,
    resolve,
)
from edged.projects.sdist import Sdist, fetch_sdist, require_tests
from edged.projects.testdeps import TestDeps, find_test_deps
from edged.projects.venv import adopt_scripts, fix_shebangs, make_venv, site_packages

if TYPE_CHECKING:
    from layerfs.store import Store

log = logging.getLogger("edged.projects")

DEFAULT_ROOTFS = "/var/cache/edged-test/debian-rootfs.tar"
#: Where the toolkit layer installs pytest (a ``pip --target`` prefix).
TOOLKIT = "/opt/toolkit"
#: The venv the workspace layer installs the project and its test dependencies into.
PROJECT_ENV = "/work/.venv"
#: The sandbox's Python (the base layer's).
PYTHON = "/usr/bin/python3"
#: pytest's options for every run (the project's own configuration applies too; the
#: command line wins over its ``addopts``): quiet, no cache written, no colours to parse.
PYTEST_OPTIONS = ("-q", "-p", "no:cacheprovider", "--color=no")


@dataclass(frozen=True)
class ProjectImage:
    """Layers and run settings of one project. ``layers``: {"base"|"workspace"|"toolkit":
    digest}; ``project_dir``: the sdist's tree in the sandbox; ``env``: the environment its
    test run needs (:func:`sandbox_env`); ``workspace_dists``/``toolkit_dists``: {name:
    version} installed in each layer; ``pytest_pinned``: whether the project's environment
    was resolved with the toolkit's pytest (False: it has its own); ``test_argv``: the test
    run, from ``project_dir`` (:func:`test_argv`)."""

    requirement: str
    name: str
    version: str
    layers: dict[str, str]
    project_dir: str
    env: dict[str, str]
    test_deps: TestDeps
    workspace_dists: dict[str, str]
    toolkit_dists: dict[str, str]
    pytest_pinned: bool = True
    test_argv: tuple[str, ...] = ()
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def lowers(self) -> list[str]:
        """The layer digests bottom first, as an image lists them."""
        return [self.layers["base"], self.layers["workspace"], self.layers["toolkit"]]


def sandbox_env(project_env: str = PROJECT_ENV) -> dict[str, str]:
    """The environment of a test run: the project's venv active (its ``bin`` first on
    ``PATH``, so ``python``/``python3``/``pytest`` in a shell or a test's subprocess are the
    venv's); no ``.pyc`` written (the layers carry them)."""
    return {"VIRTUAL_ENV": project_env,
            "PATH": f"{project_env}/bin:{TOOLKIT}/bin:/usr/local/bin:/usr/bin:/bin",
            "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}


def test_argv(own_pytest: bool) -> tuple[str, ...]:
    """The test run: the project's own ``pytest`` script when its venv has one (its test
    dependencies excluded the toolkit's pytest), else the toolkit's, whose ``#!/usr/bin/env
    python3`` finds the venv's Python first on ``PATH``."""
    script = f"{PROJECT_ENV}/bin/pytest" if own_pytest else f"{TOOLKIT}/bin/pytest"
    return (script, *PYTEST_OPTIONS)


test_argv.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def ensure_rootfs(path: str) -> str:
    """The Debian rootfs tarball at ``path``, made with mmdebstrap if missing."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        log.info("making %s with mmdebstrap (minbase + python3, bookworm)", path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # mmdebstrap picks its output format from the name: keep the .tar ending.
        part = os.path.join(os.path.dirname(path) or ".", f".rootfs.{os.getpid()}.tar")
        try:
            subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase",
                            "--include=python3", "bookworm", part], check=True)
            os.replace(part, path)
        finally:
            Path(part).unlink(missing_ok=True)
    return path


_PY_LIB = re.compile(r"^(?:\./)?usr/lib/python(3\.\d+)/os\.py$")


def base_python(rootfs: str) -> str | None:
    """``major.minor`` of the Python in a rootfs (a tarball or a directory), from its
    ``usr/lib/python3.N/os.py``; None if it has none (or several)."""
    found: set[str] = set()
    if os.path.isdir(rootfs):
        for p in Path(rootfs, "usr", "lib").glob("python3.*/os.py"):
            found.add(p.parent.name.removeprefix("python"))
    else:
        with tarfile.open(rootfs) as tf:
            for m in tf:
                hit = _PY_LIB.match(m.name)
                if hit:
                    found.add(hit.group(1))
    return found.pop() if len(found) == 1 else None


def check_python(rootfs: str) -> None:
    """Raise :class:`PythonMismatch` when the rootfs's Python is not the one running pip."""
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = base_python(rootfs)
    if base is None:
        raise PythonMismatch(f"the base rootfs {rootfs} has no (single) python3: its "
                             "usr/lib/python3.N/os.py was not found")
    if base != host:
        raise PythonMismatch(f"the base rootfs has Python {base}, edged runs Python {host}: "
                             f"pip would pick wheels and markers for {host}; run edged "
                             f"with Python {base}")


def _build(tree: str, kind: str, store: Store, clamp: bool) -> str:
    from layerfs.build import build_layer  # the C core: loaded only when layers are built

    return build_layer(tree, kind=kind, store=store, clamp_mtime=clamp).digest


def build_toolkit(store: Store, work: Path, pytest_req: str = "pytest") -> tuple[str,
                                                                                 dict[str, str]]:
    """The toolkit layer (pytest and its dependencies at :data:`TOOLKIT`); returns (digest,
    {name: version} of what it holds). Raises :class:`ProjectError`."""
    tree = work / "toolkit"
    target = tree / TOOLKIT.lstrip("/")
    shutil.rmtree(tree, ignore_errors=True)
    pip(["install", "-q", "--no-compile", "--ignore-installed", "--target", str(target),
         pytest_req], what=f"installing the toolkit ({pytest_req})", project="pytest")
    # its scripts run the first python3 on PATH: the project's venv, which sees the toolkit
    fix_shebangs(target / "bin", "/usr/bin/env python3")
    if not compile_for_sandbox(target, TOOLKIT):
        log.info("toolkit: some .py files did not compile ahead of time")
    return _build(str(tree), "toolkit", store, True), installed(target)


def plan_workspace(resolved: Sequence[Dist], toolkit: dict[str, str],
                   project: str) -> tuple[list[Dist], list[Dist]]:
    """Split a resolved project environment into (what the workspace installs, what the
    toolkit already provides at the same version). The project itself is always installed
    (it is built from the sdist under test, whatever version the toolkit has)."""
    proj = canonicalize_name(project)
    mine, shared = [], []
    for d in resolved:
        if d.name != proj and toolkit.get(d.name) == d.version:
            shared.append(d)
        else:
            mine.append(d)
    return mine, shared


def _resolve_env(sdist: Sdist, deps: TestDeps, toolkit: dict[str, str],
                 requirement: str) -> tuple[list[Dist], bool]:
    spec = f"{sdist.name}[{','.join(deps.extras)}]" if deps.extras else sdist.name
    reqs = [f"{spec}=={sdist.version}", *deps.requirements]
    what = f"resolving the test environment of {requirement}"
    pytest_v = toolkit.get("pytest")
    if pytest_v:
        try:
            dists, _ = resolve([*reqs, f"pytest=={pytest_v}"], project=sdist.name, what=what)
            return dists, True
        except ProjectError as e:
            if e.code != "dependency_failed":
                raise
            log.info("%s: its test dependencies cannot have the toolkit's pytest %s; "
                     "resolving without it (its own pytest then goes into the venv and wins)",
                     requirement, pytest_v)
    dists, _ = resolve([*reqs, "pytest"], project=sdist.name, what=what)
    return dists, False


def _provides_extra(sdist: Sdist, requirement: str) -> tuple[str, ...]:
    if sdist.provides_extra is not None:
        return sdist.provides_extra
    # PKG-INFO cannot be trusted for extras: ask the project's build backend
    _, meta = resolve([f"{sdist.name}=={sdist.version}"], project=sdist.name, no_deps=True,
                      what=f"reading the metadata of {requirement}")
    return tuple(meta.get("provides_extra") or ())


def build_workspace(sdist: Sdist, deps: TestDeps, toolkit: dict[str, str], store: Store,
                    work: Path, requirement: str) -> tuple[str, dict[str, str], bool]:
    """The workspace layer: the sdist's tree at ``/work/<name>`` and the project's venv at
    :data:`PROJECT_ENV` (the module's docstring). Returns (digest, {name:
    version} installed there, whether it was resolved with the toolkit's pytest). Raises
    :class:`ProjectError`."""
    dists, pinned = _resolve_env(sdist, deps, toolkit, requirement)
    mine, shared = plan_workspace(dists, toolkit, sdist.name)
    if shared:
        log.info("%s: from the toolkit: %s", requirement, ", ".join(d.pin for d in shared))
    tree = work / "workspace"
    shutil.rmtree(tree, ignore_errors=True)
    venv = tree / PROJECT_ENV.lstrip("/")
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"  # the base's (checked)
    site = make_venv(venv, prefix=PROJECT_ENV, python=PYTHON, pyver=pyver, after=[TOOLKIT])
    install_target(site, [d.pin for d in mine], project=sdist.name,
                   what=f"installing the test environment of {requirement}")
    adopt_scripts(site, venv, f"{PROJECT_ENV}/bin/python")
    inside = f"/work/{sdist.name}"
    shutil.copytree(sdist.root, tree / inside.lstrip("/"), symlinks=True)
    for root, where in ((site, site_packages(PROJECT_ENV, pyver)),
                        (tree / inside.lstrip("/"), inside)):
        if not compile_for_sandbox(root, where):
            log.info("%s: some .py files under %s did not compile ahead of time",
                     requirement, where)
    got = installed(site)
    missing = {d.name for d in mine} - set(got)
    if missing:
        raise ProjectError(f"installing the test environment of {requirement}: "
                           f"{', '.join(sorted(missing))} not installed")
    if (venv / "bin" / "pytest").exists() != ("pytest" in got):
        raise ProjectError(f"installing the test environment of {requirement}: pytest "
                           "installed without its script, or a script without pytest")
    return _build(str(tree), "workspace", store, True), got, pinned


def build_project_image(requirement: str, *, work: Path, rootfs: str = DEFAULT_ROOTFS,
                        store_dir: str | None = None,
                        extra_test_deps: Sequence[str] = ()) -> ProjectImage:
    """Build the base, toolkit and workspace layers of ``requirement`` (``NAME`` or
    ``NAME==VERSION`` on the package index) into the layer store ``store_dir`` (default
    layerfs's), using ``work`` (an empty directory, removed by the caller) for the trees.
    ``extra_test_deps``: requirements added to the project's environment. Raises a
    :class:`ProjectError` subclass saying why the project's tests cannot run (no release,
    no sdist, no tests, a build or a dependency that failed, a Python mismatch, the index
    unreachable)."""
    from layerfs.store import Store

    store = Store(store_dir or None)
    # The workspace and toolkit trees are fresh files (copies, pip): their mtimes are
    # clamped to SOURCE_DATE_EPOCH so that the same inputs give the same digests and the
    # store dedups whole layers across rollouts.
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1700000000")
    times: dict[str, float] = {}

    t0 = time.monotonic()
    sdist = fetch_sdist(requirement, work / "sdist")
    require_tests(sdist)
    log.info("%s: sdist %s (%.1fs)", requirement, sdist.archive.name, time.monotonic() - t0)

    rootfs = ensure_rootfs(rootfs)
    check_python(rootfs)
    t0 = time.monotonic()
    base = _build(rootfs, "base", store, False)
    times["base"] = time.monotonic() - t0
    log.info("base layer %s (%.1fs)", base[:19], times["base"])

    t0 = time.monotonic()
    toolkit, toolkit_dists = build_toolkit(store, work)
    times["toolkit"] = time.monotonic() - t0
    log.info("toolkit layer %s: %s (%.1fs)", toolkit[:19],
             ", ".join(f"{k}=={v}" for k, v in sorted(toolkit_dists.items())), times["toolkit"])

    provides = _provides_extra(sdist, requirement)
    deps = find_test_deps(sdist.root, sdist.name, provides)
    if extra_test_deps:
        deps = TestDeps(deps.extras, (*deps.requirements, *extra_test_deps),
                        (*deps.sources, "--test-dep"), deps.skipped)
    log.info("%s: test dependencies from %s: %s", requirement,
             ", ".join(deps.sources) or "nothing declared",
             ", ".join([*(f"[{x}]" for x in deps.extras), *deps.requirements]) or "none")
    for s in deps.skipped:
        log.info("%s: not read: %s", requirement, s)

    t0 = time.monotonic()
    workspace, ws_dists, pinned = build_workspace(sdist, deps, toolkit_dists, store, work,
                                                  requirement)
    times["workspace"] = time.monotonic() - t0
    log.info("workspace layer %s: %s (%.1fs)", workspace[:19],
             ", ".join(f"{k}=={v}" for k, v in sorted(ws_dists.items())), times["workspace"])
    return ProjectImage(requirement, sdist.name, sdist.version,
                        {"base": base, "workspace": workspace, "toolkit": toolkit},
                        f"/work/{sdist.name}", sandbox_env(), deps, ws_dists, toolkit_dists,
                        pinned, test_argv("pytest" in ws_dists), timings_s=times)
