"""Tests of the CLI progress bar: drawn only on a terminal, erased at the end."""

from __future__ import annotations

import io

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
