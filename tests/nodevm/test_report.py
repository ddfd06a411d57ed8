"""The host side of scripts/node-vm.sh (runs everywhere): the guest's JUnit XML read into
cases, which skips are allowed on a production-like node, the verdict and the last line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nodevm import report

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
