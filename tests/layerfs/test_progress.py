"""Tests of the CLI progress bar: drawn only on a terminal, erased at the end."""

from __future__ import annotations

import io

import pytest

from layerfs.progress import Bar, human_bytes


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_draws_on_a_tty_and_erases() -> None:
    out = _Tty()
    with Bar("storing", stream=out) as bar:
        bar(512, 1024)
        bar(1024, 1024)
    text = out.getvalue()
    assert "storing [" in text and "100.0%" in text and "1.0 KiB/1.0 KiB" in text
    assert text.endswith("\r\x1b[K")


def test_bar_is_silent_when_not_a_tty() -> None:
    out = io.StringIO()
    with Bar("storing", stream=out) as bar:
        bar(1, 2)
        bar(2, 2)
    assert out.getvalue() == ""


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"


def test_rate_is_not_shown_from_a_too_short_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    # Review finding: the first sample showed 3.8 TiB/s (bytes over microseconds).
    import layerfs.progress as progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = _Tty()
    bar = Bar("storing", stream=out)
    bar(4 << 20, 8 << 30)          # first report: 4 MiB already done by an earlier stage
    now[0] += 0.2
    bar(8 << 20, 8 << 30)
    assert "TiB/s" not in out.getvalue() and "-- B/s" in out.getvalue()
    now[0] += 0.8                  # 1 s after the first report, 12 MiB more
    bar(16 << 20, 8 << 30)
    last = out.getvalue().rsplit("\r", 1)[-1]
    assert "12.0 MiB/s" in last, last
