"""A pytest plugin for the node VM's guest (``-p tests.nodevm.stream``): every test's start
and outcome written as one line as it happens, so that a run cut short (killed at its
bound, a hung test, a guest that crashed) still tells which tests passed, failed or were
running. JUnit XML is written only at the session's end.

Lines go to each path in ``$NODEVM_STREAM`` (``:``-separated; ``guest/run.sh`` gives the
serial console, which the host reads as the run goes, and a file on the results disk)::

    nodevm-case: start tests/x/test_y.py::test_z[a%20b]
    nodevm-case: passed 1.25 tests/x/test_y.py::test_z[a%20b]
    nodevm-case: failed 3.50 tests/x/test_y.py::test_q AssertionError: ...

Each line is one ``write`` (so lines from the guest's other writers to the console do not
split it); in the test id ``%`` and spaces are written ``%25`` and ``%20`` (:func:`quote_id`),
so it ends at the first space; the rest of an outcome's line is the first line of the
failure's or skip's text, at most :data:`MESSAGE_MAX` characters. The host side reads them back with
:func:`tests.nodevm.report.parse_stream`.

After each test a second line says where the guest's memory is (:func:`memory_line`: what
a global OOM report's counters leave out, vmalloc and per-cpu memory, dying cgroups and
zram's compressed pages among it)::

    nodevm-mem: tests/x/test_y.py::test_z MemAvailable=3012 VmallocUsed=40 Percpu=6 ...
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

from tests.nodevm.report import MEM_PREFIX
from tests.nodevm.report import STREAM_PREFIX as PREFIX

MESSAGE_MAX = 300
#: /proc/meminfo fields in the memory line (MiB)
MEMINFO_FIELDS = ("MemAvailable", "MemFree", "Cached", "Shmem", "AnonPages", "Slab",
                  "SUnreclaim", "KernelStack", "PageTables", "VmallocUsed", "Percpu",
                  "SwapTotal", "SwapFree")

_fds: list[int] = []
_reports: dict[str, list[pytest.TestReport]] = {}


def pytest_configure(config: pytest.Config) -> None:
    for path in filter(None, os.environ.get("NODEVM_STREAM", "").split(":")):
        try:
            _fds.append(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOCTTY,
                                0o644))
        except OSError as e:  # a missing console must not stop the run
            print(f"nodevm stream: cannot open {path}: {e}")


def pytest_unconfigure(config: pytest.Config) -> None:
    while _fds:
        os.close(_fds.pop())


def _emit(text: str) -> None:
    line = (" ".join(text.split("\n")) + "\n").encode(errors="replace")
    for fd in _fds:
        with contextlib.suppress(OSError):
            os.write(fd, line)


def outcome_of(reports: list[Any]) -> tuple[str, float, str]:
    """(outcome, seconds, message) of one test from its phase reports, as JUnit has them:
    a failed setup or teardown is ``error``, a failed call ``failed``, a skip in any phase
    ``skipped`` (an expected failure too), else ``passed``; seconds summed over the phases."""
    seconds = sum(float(getattr(r, "duration", 0.0)) for r in reports)
    for r in reports:
        if r.failed:
            kind = "failed" if r.when == "call" and not hasattr(r, "wasxfail") else "error"
            return kind, seconds, _message(r)
    for r in reports:
        if r.skipped:
            return "skipped", seconds, _message(r)
    return "passed", seconds, ""


def _message(r: Any) -> str:
    longrepr = r.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr or "")
    first = text.strip().split("\n", 1)[0]
    return first[:MESSAGE_MAX]


def quote_id(nodeid: str) -> str:
    """``nodeid`` with ``%`` and spaces percent-encoded (one word on the line)."""
    return nodeid.replace("%", "%25").replace(" ", "%20")


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _reports[nodeid] = []
    _emit(f"{PREFIX} start {quote_id(nodeid)}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _reports.setdefault(report.nodeid, []).append(report)


def memory_line(nodeid: str, proc: str = "/proc", sysfs: str = "/sys") -> str:
    """One line of where the memory is: :data:`MEMINFO_FIELDS` in MiB, the cgroup tree's
    live and dying descendants (``cgroup.stat``: a dying memory cgroup keeps its per-cpu
    counters and the pages charged to it) and zram's RAM in use (MiB, all devices, from
    ``mm_stat``). What cannot be read is left out."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open(f"{proc}/meminfo") as f:
        for row in f:
            name, _, rest = row.partition(":")
            if name in MEMINFO_FIELDS:
                fields[name] = str(int(rest.split()[0]) >> 10)
    with contextlib.suppress(OSError, ValueError), open(f"{sysfs}/fs/cgroup/cgroup.stat") as f:
        names = {"nr_descendants": "cgroups", "nr_dying_descendants": "dying"}
        for row in f:
            k, v = row.split()
            if k in names:
                fields[names[k]] = v
    zram = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(f"{sysfs}/block"):
            if name.startswith("zram"):
                with contextlib.suppress(OSError, ValueError, IndexError), \
                        open(f"{sysfs}/block/{name}/mm_stat") as f:
                    zram += int(f.read().split()[2])  # mem_used_total, bytes
    fields["zram"] = str(zram >> 20)
    return f"{MEM_PREFIX} {quote_id(nodeid)} " + " ".join(f"{k}={v}" for k, v in fields.items())


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    outcome, seconds, message = outcome_of(_reports.pop(nodeid, []))
    _emit(f"{PREFIX} {outcome} {seconds:.2f} {quote_id(nodeid)} {message}".rstrip())
    _emit(memory_line(nodeid))
