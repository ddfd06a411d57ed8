"""Every benchmark in ``bench/`` at least starts: its imports resolve and ``--help`` works.

A benchmark is run by hand, rarely, so an import that a refactor broke (``fetch_sdist``
moved from ``edged.rollout`` to ``edged.projects.sdist``) went unseen until the figures
were due. This runs each one's ``--help`` in a fresh interpreter (imports only, nothing
measured)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_benchmark_starts(script: Path) -> None:
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                       text=True, timeout=120, cwd=BENCH.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower(), r.stdout[-500:]
