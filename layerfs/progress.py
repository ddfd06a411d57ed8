"""A small progress bar for long CLI work, on stderr, only when stderr is a terminal.

No dependency: a line redrawn with ``\\r`` at most ten times a second, erased when done, so
that logs and pipes never see control characters.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_MIN_RATE_SECONDS = 0.5
"""No rate is shown before this much time (seconds) has passed since the first report."""


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units with one decimal: ``'1.5 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Bar:
    """A byte-progress bar labelled ``label``; call it as ``bar(done, total)``.

    ``total`` 0 means unknown (shows bytes and rate only). Disabled (a no-op) when
    ``stream`` is not a TTY or ``enabled`` is False. Use as a context manager so the line is
    erased at the end.
    """

    def __init__(self, label: str, *, stream: TextIO | None = None,
                 enabled: bool | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._t0: float | None = None  # first report: earlier stages are not in the rate
        self._done0 = 0
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._t0 is None:
            # The rate counts from the first report, bytes and time alike: bytes done
            # before it (another stage, a resumed transfer) took unknown time.
            self._t0, self._done0 = now, done
        if now - self._last < 0.1 and done != total:
            return
        self._last = now
        elapsed = now - self._t0
        # A rate over a few milliseconds is noise (a first sample showed 3.8 TiB/s).
        speed = (f"{human_bytes((done - self._done0) / elapsed)}/s"
                 if elapsed >= _MIN_RATE_SECONDS else "-- B/s")
        if total > 0:
            frac = min(done / total, 1.0)
            width = 24
            fill = int(frac * width)
            text = (f"{self.label} [{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% "
                    f"{human_bytes(done)}/{human_bytes(total)} {speed}")
        else:
            text = f"{self.label} {human_bytes(done)} {speed}"
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
