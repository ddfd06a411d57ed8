"""The daemon's descriptors as a resource: the soft limit raised, creates refused before
EMFILE."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap

import pytest

from edged.errors import CapacityExhausted
from edged.node.fds import FdBudget, open_fds, raise_nofile


def test_open_fds_counts_this_process() -> None:
    before = open_fds()
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(10)]
    try:
        assert open_fds() == before + 10
    finally:
        for fd in fds:
            os.close(fd)


def test_raise_nofile_lifts_the_soft_limit_to_the_hard_one() -> None:
    """In a child process with the soft limit at 256 (what a shell often leaves)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard NOFILE limit is {hard}")
    prog = textwrap.dedent("""
        import resource
        from edged.node.fds import raise_nofile
        before, now = raise_nofile()
        print(before, now, *resource.getrlimit(resource.RLIMIT_NOFILE))
    """)

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    out = subprocess.run([sys.executable, "-c", prog], preexec_fn=low, capture_output=True,
                         text=True, check=True).stdout.split()
    before, now, soft, hard2 = map(int, out)
    assert before == 256 and now == soft == hard2
    assert raise_nofile()[1] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_budget_refuses_before_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = FdBudget(per_create=16, reserve=64, retry_after_s=3.0)
    base = open_fds()
    monkeypatch.setattr(FdBudget, "limit", staticmethod(lambda: base + 16 + 2 + 64 + 10))
    held: list[int] = []
    try:
        admitted = 0
        with pytest.raises(CapacityExhausted) as ei:
            for _ in range(100):
                budget.check(len(held), 2)
                held += [os.open("/dev/null", os.O_RDONLY) for _ in range(2)]  # the sandbox
                admitted += 1
        # this close to the limit every create counts: exact
        assert admitted == 6
        assert ei.value.retry_after == 3.0 and ei.value.status == 503
        assert "soft NOFILE limit" in str(ei.value)
    finally:
        for fd in held:
            os.close(fd)


def test_budget_estimates_between_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = FdBudget(per_create=0, reserve=0)
    monkeypatch.setattr(FdBudget, "limit", staticmethod(lambda: 1 << 20))
    counted = budget.estimate(0)
    monkeypatch.setattr("edged.node.fds.open_fds", lambda: 10**9)  # not called again soon
    assert budget.estimate(40) == counted + 40
    assert budget.estimate(10) == counted + 10
