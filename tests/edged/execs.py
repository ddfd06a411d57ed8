"""Helpers of the tests that run execs: an exec's whole output and end, waiting for a
host process to be gone, and waiting for a condition (not a fixed sleep: a loaded machine
takes longer, a broken one never gets there)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from edged.backends.base import ExecEnd, ExecHandle

T = TypeVar("T")

#: How long a test waits for what it waits on: generous, as the machine may be loaded
#: (load 100 on 2 cores is seen); a condition that never comes still fails the test.
PATIENCE_S = 60.0


async def collect(h: ExecHandle) -> tuple[bytes, bytes, ExecEnd]:
    """(stdout, stderr, end) of an exec, read to its end."""
    out, err = bytearray(), bytearray()
    async for ev in h.events():
        if isinstance(ev, ExecEnd):
            return bytes(out), bytes(err), ev
        (out if ev[0] == "stdout" else err).extend(ev[1])
    raise AssertionError("no ExecEnd")


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    """True once host process ``pid`` has exited (its parent reaps it, asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True  # gone (ESRCH: being reaped as /proc/<pid>/stat was read)
        if stat[stat.rindex(")") + 2] in "ZX":
            return True
        time.sleep(0.01)
    return False


async def eventually(probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str,
                     timeout_s: float = PATIENCE_S, interval_s: float = 0.05) -> T:
    """Call ``probe`` until ``ok`` holds for its result, and return that result; raise
    AssertionError naming ``what`` (with the last result) after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await probe()
        if ok(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {got!r})")
        await asyncio.sleep(interval_s)
