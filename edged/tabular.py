"""Plain-text tables for the CLIs' human output."""

from __future__ import annotations


def table(rows: list[list[str]], header: list[str]) -> str:
    """``rows`` under ``header``, each column as wide as its widest cell, two spaces apart,
    no trailing blanks."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)
