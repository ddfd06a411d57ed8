"""Bounds of the tests' waits on slow machines: every wait polls for its condition and ends
as soon as it holds; only the bound, after which the test fails, is scaled by
``EDGED_TEST_TIME_SCALE`` (default 1; the node VM's guest sets it: TCG emulation on a shared
host runs the same work several times slower). Never a sleep of a fixed length."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SCALE = max(1.0, float(os.environ.get("EDGED_TEST_TIME_SCALE") or 1))


def bound(seconds: float) -> float:
    """``seconds`` scaled for this machine (never less)."""
    return seconds * SCALE


def wait_until(cond: Callable[[], object], seconds: float, what: str,
               interval: float = 0.02) -> None:
    """Poll ``cond()`` every ``interval`` s until it is true; AssertionError naming ``what``
    once :func:`bound` (``seconds``) have passed."""
    deadline = time.monotonic() + bound(seconds)
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {bound(seconds):.0f} s waiting for {what}")
        time.sleep(interval)
