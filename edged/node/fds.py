"""The daemon's file descriptors as a node resource: the soft limit raised at start, and
creates refused (a typed 503) before an ``open`` anywhere in the daemon could fail EMFILE.

Every sandbox holds a few descriptors in the daemon for its life (the container backend: a
pidfd and sbx-init's control socket), every API connection one, every create a few more for
a moment (spawner pipes, the control socket's connect, record and meta files). A shell or a
supervisor often leaves the soft ``RLIMIT_NOFILE`` at 1024: at ~500 sandboxes every
``open`` failed, records could not be saved and the accept loop spun. So
:func:`raise_nofile` lifts the soft limit to the hard one at start (as the lazy server
does), and :class:`FdBudget` admits a create only while the descriptors open now, plus what
the new sandbox will hold, plus a reserve for connections and file transfers, fit under
the soft limit. Counting ``/proc/self/fd`` costs ~1 ms per thousand descriptors, so it is
counted at most once a second, or at every create once within a quarter of the limit, and
estimated in between from the number of sandboxes.

Source: getrlimit(2), proc_pid_fd(5).
"""

from __future__ import annotations

import logging
import os
import resource
import time

from edged.errors import CapacityExhausted

log = logging.getLogger("edged.node")


def raise_nofile() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (no privilege needed); returns
    (soft before, soft now). A hard limit of "infinity" is capped at ``/proc/sys/fs/nr_open``
    (the kernel refuses more)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if want == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                want = int(f.read())
        except (OSError, ValueError):
            want = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise the soft NOFILE limit %d to %d: %s", soft, want, e)
            return soft, soft
        return soft, want
    return soft, soft


def open_fds() -> int:
    """How many descriptors this process has open (``/proc/self/fd``, less the one that
    lists it)."""
    return len(os.listdir("/proc/self/fd")) - 1


class FdBudget:
    """Admission of creates against the soft NOFILE limit (see the module docstring).

    ``per_create``: what a create needs on top of what the new sandbox will hold while it
    runs; ``reserve``: kept free for API connections, exec streams and file transfers
    (default: 64, or 1/16 of the limit if more); ``retry_after_s``: the refusal's
    Retry-After.
    """

    def __init__(self, *, per_create: int = 16, reserve: int | None = None,
                 retry_after_s: float = 1.0) -> None:
        self.per_create = per_create
        self.reserve = reserve
        self.retry_after_s = retry_after_s
        self._counted = 0
        self._counted_at = -1e9
        self._counted_held = 0

    @staticmethod
    def limit() -> int:
        """The soft NOFILE limit now (a huge number if unlimited)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return 1 << 40 if soft == resource.RLIM_INFINITY else soft

    def estimate(self, held: int) -> int:
        """Descriptors open now: counted, or estimated from the last count and ``held``,
        what the daemon's sandboxes hold now (the sum of their backends'
        ``fds_per_sandbox``) against what they held then."""
        limit = self.limit()
        now = time.monotonic()
        guess = self._counted + held - self._counted_held
        if now - self._counted_at >= 1.0 or guess > limit * 3 // 4:
            self._counted, self._counted_at = open_fds(), now
            self._counted_held = held
            return self._counted
        return guess

    def check(self, held: int, need: int) -> None:
        """Admit a sandbox that will hold ``need`` descriptors while the daemon's sandboxes
        hold ``held``, or raise :class:`CapacityExhausted` (503, ``retry_after``) naming
        the figures."""
        limit = self.limit()
        reserve = self.reserve if self.reserve is not None else max(64, limit // 16)
        open_now = self.estimate(held)
        if open_now + self.per_create + need + reserve > limit:
            raise CapacityExhausted(
                f"capacity exhausted: file descriptors: {open_now} open in the daemon + "
                f"{self.per_create + need} for a new sandbox + {reserve} kept for "
                f"connections > the soft NOFILE limit {limit}",
                retry_after=self.retry_after_s)


__all__ = ["FdBudget", "open_fds", "raise_nofile"]
