"""Memory advice over a live process's private mappings (the C core's
``lfs_process_advise``): page cold pages out to swap on reclaim, read them back ahead of use
on resume. See ``csrc/include/lfs_memory.h`` for which mappings and why."""

from __future__ import annotations

import os
from dataclasses import dataclass

from edged.native import check, ffi, lib, new_error

PAGEOUT = "pageout"
COLD = "cold"
WILLNEED = "willneed"
_ADVICE = {PAGEOUT: lib.LFS_MADV_PAGEOUT, COLD: lib.LFS_MADV_COLD,
           WILLNEED: lib.LFS_MADV_WILLNEED}


@dataclass(frozen=True)
class Advised:
    """What one call advised: ``ranges`` mappings, ``bytes`` of them (virtual size, not what
    moved: compare memory counters for that), ``skipped`` mappings the kernel refused."""

    ranges: int = 0
    bytes: int = 0
    skipped: int = 0

    def __add__(self, other: Advised) -> Advised:
        return Advised(self.ranges + other.ranges, self.bytes + other.bytes,
                       self.skipped + other.skipped)


def advise(pid: int, advice: str) -> Advised:
    """Give ``advice`` (``"pageout"``, ``"cold"``, ``"willneed"``) for the private mappings
    of host process ``pid``. A process that is gone is advised nothing. Raises ValueError
    (unknown advice), OSError (EPERM: needs CAP_SYS_NICE and ptrace read access)."""
    code = _ADVICE.get(advice)
    if code is None:
        raise ValueError(f"advice {advice!r}: not one of {', '.join(_ADVICE)}")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return Advised()
    try:
        st = ffi.new("struct lfs_advise_stats *")
        err = new_error()
        check(lib.lfs_process_advise(pidfd, pid, code, st, err), err,
              f"advise pid {pid} {advice}")
        return Advised(int(st.ranges), int(st.bytes), int(st.skipped))
    finally:
        os.close(pidfd)
