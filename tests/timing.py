"""Bounds of the tests' waits on slow machines: every wait polls for its condition and ends
as soon as it holds; only the bound, after which the test fails, is scaled by
``EDGED_TEST_TIME_SCALE`` (default 1; the node VM's guest sets it: TCG emulation on a shared
host runs the same work several times slower). Never a sleep of a fixed length."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SCALE = max(1.0, float(os.environ.get("EDGED_TEST_TIME_SCALE") or 1))
#: The share of a repetition-heavy test's rounds that run (``EDGED_TEST_REPEATS``, 0-1,
#: default 1: all). The node VM's guest runs a quarter: there the tests are for the code
#: paths of its kernel, cgroup v2 and AppArmor, while how often a race shows is the host's
#: business (the default suite runs every round); under TCG at a 5 % CPU quota 240 execs
#: took 6 min.
REPEATS = min(1.0, max(0.0, float(os.environ.get("EDGED_TEST_REPEATS") or 1)))


def bound(seconds: float) -> float:
    """``seconds`` scaled for this machine (never less)."""
    return seconds * SCALE


def repeats(n: int, least: int = 1) -> int:
    """How many of a test's ``n`` rounds to run here: :data:`REPEATS` of them, never fewer
    than ``least`` (nor more than ``n``)."""
    return min(n, max(least, round(n * REPEATS)))


def wait_until(cond: Callable[[], object], seconds: float, what: str,
               interval: float = 0.02) -> None:
    """Poll ``cond()`` every ``interval`` s until it is true; AssertionError naming ``what``
    once :func:`bound` (``seconds``) have passed."""
    deadline = time.monotonic() + bound(seconds)
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {bound(seconds):.0f} s waiting for {what}")
        time.sleep(interval)
