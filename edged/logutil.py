"""Logging helpers of the daemon: a rate limit for repeated log lines.

A failure that repeats (every accept of a listening socket at EMFILE, every request of a
broken route) must not flood the log: at 503 sandboxes with the soft NOFILE limit at 1024,
asyncio's accept loop logged 78,844 tracebacks in 30 s. :class:`RateLimitFilter` passes the
first ``burst`` records of each kind of line per ``period_s`` and counts the rest; the next
record of that kind that passes carries ``suppressed`` (how many were dropped before it),
which :class:`edged.daemon.JsonFormatter` prints like any other ``extra`` field.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass


@dataclass
class _Window:
    start: float
    passed: int = 0
    dropped: int = 0


class RateLimitFilter(logging.Filter):
    """At most ``burst`` records per ``period_s`` seconds for each kind of line at level
    ``min_level`` or above (below it, e.g. the info line of every create, all pass): the same
    logger, level, message template (``record.msg`` before ``%`` formatting, so lines that
    differ only in their arguments are one kind) and exception type. Dropped records are
    counted; the first record let through after them has ``record.suppressed`` set to that
    count. At most ``max_kinds`` kinds are tracked (the least recently seen is forgotten).
    Thread-safe. Attach it to a handler (every logger writing there) or a logger."""

    def __init__(self, period_s: float = 10.0, burst: int = 5, max_kinds: int = 1024,
                 min_level: int = logging.WARNING) -> None:
        super().__init__()
        if period_s <= 0 or burst < 1 or max_kinds < 1:
            raise ValueError("period_s > 0, burst >= 1 and max_kinds >= 1")
        self.period_s = period_s
        self.burst = burst
        self.max_kinds = max_kinds
        self.min_level = min_level
        self._windows: collections.OrderedDict[tuple[object, ...], _Window] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return True
        exc = record.exc_info[0] if record.exc_info else None
        msg = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        kind = (record.name, record.levelno, msg, exc)
        now = time.monotonic()
        with self._lock:
            w = self._windows.get(kind)
            carried = 0
            if w is None or now - w.start >= self.period_s:
                carried = w.dropped if w is not None else 0
                w = self._windows[kind] = _Window(now)
                if len(self._windows) > self.max_kinds:
                    self._windows.popitem(last=False)
            self._windows.move_to_end(kind)
            if w.passed >= self.burst:
                w.dropped += 1
                return False
            w.passed += 1
        if carried:
            record.suppressed = carried
        return True


__all__ = ["RateLimitFilter"]
