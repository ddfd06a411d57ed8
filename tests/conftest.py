"""Shared test fixtures and capability checks.

Tests that need root, mounts, FUSE or a VM carry a marker (see pyproject.toml) and skip
with a stated reason where the capability is missing.
"""

from __future__ import annotations

import os
import shutil

import pytest


def _is_root() -> bool:
    return os.geteuid() == 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") and not _is_root():
        pytest.skip("needs root")
    if item.get_closest_marker("mount") and not _is_root():
        pytest.skip("needs root to mount(2) EROFS/overlayfs")
    if item.get_closest_marker("fuse") and not (os.path.exists("/dev/fuse") and _is_root()):
        pytest.skip("needs /dev/fuse and root")
    if item.get_closest_marker("vm") and not shutil.which("qemu-system-x86_64"):
        pytest.skip("needs qemu-system-x86_64")


# -- cgroups a run leaves behind -------------------------------------------------------------
# Every cgroup hierarchy an edged backend of this test process sets up (its
# ``edged-<hash>`` directories under each v1 controller, the best-effort cpu sibling, the
# directory in the controller-less unified hierarchy for BPF) is recorded with the test
# that made it; at the session's end any of those directories still on the host fails the
# run, naming the directory and the test. Daemons run as child processes of a test (``edged
# serve``) are not seen here (their tests check their own leftovers).

CGROUP_FS = "/sys/fs/cgroup/"
_made: list[tuple[str, object]] = []  # (nodeid of the test, Hierarchy)
_current = ["(collection)"]


def pytest_configure(config: pytest.Config) -> None:
    try:
        from edged.cgroups.base import Hierarchy
    except ImportError:  # the C core not built: nothing of edged runs
        return
    init = Hierarchy.__init__

    def recording_init(self: Hierarchy, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        _made.append((_current[0], self))

    Hierarchy.__init__ = recording_init  # type: ignore[method-assign]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    _current[0] = item.nodeid


def cgroups_left() -> dict[str, list[str]]:
    """The recorded hierarchies' directories on the cgroup filesystem that still exist:
    test nodeid -> paths."""
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for nodeid, h in _made:
        for p in h.all_parents():  # type: ignore[attr-defined]
            s = str(p)
            if s in seen or not s.startswith(CGROUP_FS):
                continue
            seen.add(s)
            if os.path.isdir(s):
                out.setdefault(nodeid, []).append(s)
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = cgroups_left()
    if not left:
        return
    lines = [f"  {p}   (made during {nodeid})" for nodeid, ps in left.items() for p in ps]
    msg = "edged cgroups this run made and left behind:\n" + "\n".join(lines)
    rep = session.config.pluginmanager.get_plugin("terminalreporter")
    if rep is not None:
        rep.write_sep("=", "cgroups left behind", red=True)
        rep.write_line(msg)
    else:
        print(msg)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
