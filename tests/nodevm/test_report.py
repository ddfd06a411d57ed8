"""The host side of scripts/node-vm.sh (runs everywhere): the guest's JUnit XML read into
cases, which skips are allowed on a production-like node, the verdict and the last line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nodevm import driver, report

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.security.test_apparmor" name="test_ok" time="1.5"/>
<testcase classname="tests.edged.backends.container.test_container.TestX" name="test_f"
 time="2.0"><failure message="AssertionError: boom">trace</failure></testcase>
<testcase classname="tests.security.test_network_scope" name="test_tcp" time="0.1">
 <skipped message="needs Landlock ABI &gt;= 4 (TCP rules)"/></testcase>
<testcase classname="tests.edged.node.test_swap" name="test_z" time="0.0">
 <skipped message="needs zram (hot_add) in the kernel"/></testcase>
<testcase classname="tests.edged.cgroups.test_cgroups" name="test_e" time="0.3">
 <error message="fixture broke"/></testcase>
</testsuite></testsuites>
"""
NODE = {"kernel": "6.1.0-57-cloud-amd64", "cgroup_fs": "cgroup2fs", "apparmor_enabled": "Y",
        "apparmor_mode": "enforce"}


def test_cases_counts_and_node_ids(tmp_path: Path) -> None:
    p = tmp_path / "junit.xml"
    p.write_text(JUNIT)
    o = report.parse_junit(p)
    assert (o.passed, o.failed, o.skipped) == (1, 2, 2)
    ids = [c.nodeid for c in o.cases]
    assert ids[0] == "tests/security/test_apparmor.py::test_ok"
    assert ids[1] == "tests/edged/backends/container/test_container.py::TestX::test_f"
    assert o.cases[1].message == "AssertionError: boom" and o.cases[1].seconds == 2.0
    # the Landlock TCP skip is one a 6.1 node must have; the zram one is not allowed
    assert [c.nodeid for c in o.bad_skips()] == ["tests/edged/node/test_swap.py::test_z"]
    assert report.summary_line(NODE, o) == (
        "node-vm: kernel 6.1.0-57-cloud-amd64, cgroup v2, apparmor enforce, 1 passed, "
        "2 failed, 2 skipped")
    why = report.verdict(NODE, o)
    assert why[0] == "2 failed" and "test_swap.py::test_z" in why[1] and len(why) == 2


def test_verdict_wants_results_cgroup_v2_and_apparmor_enforcing(tmp_path: Path) -> None:
    p = tmp_path / "junit.xml"
    p.write_text(JUNIT.replace('<failure message="AssertionError: boom">trace</failure>', "")
                 .replace('<error message="fixture broke"/>', "")
                 .replace("needs zram (hot_add) in the kernel", "needs Landlock ABI >= 4"))
    o = report.parse_junit(p)
    # an allowed reason in another file is not allowed there
    why = report.verdict(NODE, o)
    assert len(why) == 1 and "1 skipped that should run" in why[0], why
    assert "test_swap.py::test_z" in why[0]
    assert report.verdict(NODE, report.Outcome(o.cases[:3])) == []
    assert report.verdict(NODE, None) == ["no test results came back from the guest"]
    assert report.verdict(NODE, report.Outcome()) == ["no test ran"]
    hybrid = {**NODE, "cgroup_fs": "tmpfs", "apparmor_mode": "complain"}
    assert report.verdict(hybrid, report.Outcome(o.cases[:3])) == [
        "the guest's cgroups are not v2 (tmpfs)", "AppArmor is not enforcing in the guest"]
    assert report.summary_line({}, None) == (
        "node-vm: kernel unknown, cgroup unknown, apparmor off, 0 passed, 0 failed, 0 skipped")


def test_not_junit_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "x.xml"
    p.write_text("<html/>")
    with pytest.raises(ValueError, match="not JUnit"):
        report.parse_junit(p)
    p.write_text(JUNIT[:200])  # cut short: the guest stopped mid-write
    with pytest.raises(ValueError, match="not XML"):
        report.parse_junit(p)


SAMPLE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_ok():
    pass

def test_fails():
    assert 1 == 2, "boom"

def test_setup_error(broken):
    pass

def test_skips():
    pytest.skip("needs Landlock ABI >= 4")

def test_hangs():
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)  # the run cut short while this one runs
'''


def test_streamed_outcomes_survive_a_run_cut_short(tmp_path: Path) -> None:
    """The guest's plugin writes each test's start and outcome as it happens; a run killed
    mid-test (here: pytest itself, SIGKILLed in the last test, so no JUnit XML is written)
    still gives every finished test's outcome and names the one that was running."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    stream = tmp_path / "stream.txt"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NODEVM_STREAM": f"{stream}:{tmp_path / 'missing' / 'x'}",
           "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-p", "tests.nodevm.stream", "-q", "-c", str(tmp_path / "pytest.ini"),
                           "--junitxml", str(tmp_path / "junit.xml"), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert not (tmp_path / "junit.xml").exists()
    # the kernel's console puts its own text before a line; other lines are ignored
    lines = ["[  12.5] nodevm.service: " + line for line in stream.read_text().splitlines()]
    o = report.parse_stream(["guest noise", *lines])
    got = {c.nodeid.rsplit("::", 1)[-1]: (c.outcome, c.message) for c in o.cases}
    assert got == {"test_ok": ("passed", ""),
                   "test_fails": ("failed", "AssertionError: boom"),
                   "test_setup_error": ("error", "RuntimeError: fixture broke"),
                   "test_skips": ("skipped", "Skipped: needs Landlock ABI >= 4")}, got
    assert [n.rsplit("::", 1)[-1] for n in o.unfinished] == ["test_hangs"]
    assert o.partial and (o.passed, o.failed, o.skipped) == (1, 2, 1)
    assert report.summary_line(NODE, o).endswith(
        "1 passed, 2 failed, 1 skipped (cut short: outcomes as streamed)")
    why = report.verdict(NODE, o)
    assert why[0].startswith("the test run did not finish") and "test_hangs" in why[0], why
    assert why[1] == "2 failed"


def test_stream_lines_read_back() -> None:
    o = report.parse_stream([
        "nodevm-case: start tests/a.py::t1",
        "nodevm-case: passed 1.50 tests/a.py::t1",
        "nodevm-case: start tests/a.py::t2[x%20|%20100%25]",
        "nodevm-case: failed 2.00 tests/a.py::t2[x%20|%20100%25] E: no | more",
        "nodevm-case: failed notanumber tests/a.py::t3",
        "nodevm-case: bogus 1.0 tests/a.py::t4",
        "nodevm-case: start tests/a.py::t5",
    ])
    assert [(c.nodeid, c.outcome, c.seconds, c.message) for c in o.cases] == [
        ("tests/a.py::t1", "passed", 1.5, ""),
        ("tests/a.py::t2[x | 100%]", "failed", 2.0, "E: no | more")]
    assert o.unfinished == ["tests/a.py::t5"]


def test_guest_pytest_args_keep_the_markers_and_the_selection() -> None:
    sel = list(driver.SELECTION)
    assert driver.guest_pytest_args([]) == ["-m", driver.MARKERS, *sel]
    assert driver.guest_pytest_args(["-k", "apparmor"]) == ["-m", driver.MARKERS, "-k",
                                                            "apparmor", *sel]
    assert driver.guest_pytest_args(["-x", "tests/security/test_apparmor.py"]) == [
        "-m", driver.MARKERS, "-x", "tests/security/test_apparmor.py"]
    assert driver.guest_pytest_args(["-m", "slow", "tests/edged/node"]) == [
        "-m", "slow", "tests/edged/node"]


def test_memory_line_says_what_an_oom_report_leaves_out(tmp_path: Path) -> None:
    """The line after each test: meminfo in MiB (vmalloc and per-cpu memory included, which
    a global OOM's report has no counter for), live and dying cgroups, zram's RAM."""
    from tests.nodevm.stream import memory_line

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(
        "MemTotal:        4015000 kB\nMemAvailable:     204800 kB\n"
        "VmallocUsed:     3670016 kB\nPercpu:            10240 kB\nHugePages_Total: 0\n")
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cg.mkdir(parents=True)
    (cg / "cgroup.stat").write_text("nr_descendants 120\nnr_dying_descendants 7\n"
                                    "nr_subsys_memory 40\n")
    z = tmp_path / "sys" / "block" / "zram1"
    z.mkdir(parents=True)
    (z / "mm_stat").write_text(f"{1 << 30} {300 << 20} {310 << 20} 0 {320 << 20} 5 0 0 0\n")
    (tmp_path / "sys" / "block" / "vda").mkdir()
    line = memory_line("tests/a.py::t b", str(tmp_path / "proc"), str(tmp_path / "sys"))
    assert line == ("nodevm-mem: tests/a.py::t%20b MemAvailable=200 VmallocUsed=3584 "
                    "Percpu=10 cgroups=120 dying=7 zram=310")
    # nothing readable: just the zram sum
    assert memory_line("t", str(tmp_path / "none"), str(tmp_path / "none")) == \
        "nodevm-mem: t zram=0"
    # not a case line: the stream's reader skips it
    assert report.parse_stream([line]).cases == []
