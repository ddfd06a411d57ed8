"""Readers of the host's memory, pressure and process facts (edged.node.hostmem)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.node import hostmem

MEMINFO = """MemTotal:       24683652 kB
MemFree:        20000000 kB
MemAvailable:   22000000 kB
Slab:             400000 kB
HugePages_Total:       0
"""


def test_meminfo_in_bytes(tmp_path: Path) -> None:
    p = tmp_path / "meminfo"
    p.write_text(MEMINFO)
    mi = hostmem.meminfo(str(p))
    assert mi["MemTotal"] == 24683652 * 1024 and mi["MemAvailable"] == 22000000 * 1024
    assert mi["HugePages_Total"] == 0  # a count, not kB


def test_psi_parsed_and_missing_is_none(tmp_path: Path) -> None:
    p = tmp_path / "memory"
    p.write_text("some avg10=1.50 avg60=0.20 avg300=0.00 total=53109\n"
                 "full avg10=0.75 avg60=0.10 avg300=0.00 total=29603\n")
    psi = hostmem.read_psi(str(p))
    assert psi is not None
    assert psi.some == hostmem.PsiLine(1.5, 0.2, 0.0, 53109)
    assert psi.full.avg10 == 0.75 and psi.to_json()["full"]["total_us"] == 29603
    assert hostmem.read_psi(str(tmp_path / "absent")) is None
    p.write_text("weird line\n")
    assert hostmem.read_psi(str(p)) is None
    with pytest.raises(ValueError):
        hostmem.parse_psi("total=3\n")


def test_threads_and_pid_max(tmp_path: Path) -> None:
    (tmp_path / "loadavg").write_text("0.44 0.80 0.42 3/1024 26780\n")
    (tmp_path / "pid_max").write_text("32768\n")
    assert hostmem.threads(str(tmp_path / "loadavg")) == 1024
    assert hostmem.pid_max(str(tmp_path / "pid_max")) == 32768


def test_real_host_files_read() -> None:
    mi = hostmem.meminfo()
    assert mi["MemTotal"] > mi["MemAvailable"] > 0
    assert hostmem.threads() > 0 and hostmem.pid_max() >= 301
