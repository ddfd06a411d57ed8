"""Helpers of the tests that run execs: an exec's whole output and end, and waiting for a
host process to be gone."""

from __future__ import annotations

import time
from pathlib import Path

from edged.backends.base import ExecEnd, ExecHandle


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
