"""ensure_rootfs must hand mmdebstrap a temporary name ending in .tar.

mmdebstrap chooses its output format from the file name; a name like ``x.tar.123.part``
made it write a directory, which was then renamed to ``debian-rootfs.tar`` (bug seen here).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from edged.projects import image


def test_ensure_rootfs_temp_name_ends_in_tar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []

    def fake_run(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[bytes]:
        out = argv[-1]
        seen.append(out)
        Path(out).write_bytes(b"tar bytes")  # what mmdebstrap does for a *.tar name
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(image.subprocess, "run", fake_run)
    dest = tmp_path / "debian-rootfs.tar"
    assert image.ensure_rootfs(str(dest)) == str(dest)
    assert len(seen) == 1 and seen[0].endswith(".tar"), seen
    assert dest.is_file() and dest.read_bytes() == b"tar bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["debian-rootfs.tar"]
