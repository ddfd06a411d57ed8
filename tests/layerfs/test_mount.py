"""layerfs.mount helpers that the EROFS and overlay tests do not cover: the size-limited
tmpfs that holds a sandbox's upper and work directories."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from layerfs.mount import mount_tmpfs, umount


def test_tmpfs_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        mount_tmpfs(tmp_path, size=0)
    with pytest.raises(ValueError, match="permission bits"):
        mount_tmpfs(tmp_path, size=1 << 20, mode=0o17777)


@pytest.mark.root
@pytest.mark.mount
def test_tmpfs_size_limit_and_mode(tmp_path: Path) -> None:
    mp = tmp_path / "scratch"
    mp.mkdir()
    mount_tmpfs(mp, size=1 << 20, mode=0o710)
    try:
        assert os.stat(mp).st_mode & 0o7777 == 0o710
        fd = os.open(mp / "big", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError) as ei:
                for _ in range(512):
                    os.write(fd, b"x" * 4096)
            assert ei.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
    finally:
        umount(mp)
    assert not os.path.ismount(mp)
    with pytest.raises(OSError) as ei2:
        mount_tmpfs(tmp_path / "absent", size=1 << 20)
    assert ei2.value.errno == errno.ENOENT
