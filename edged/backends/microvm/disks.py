"""A microVM's writable disk: the sandbox's overlay upper.

A sparse file of the sandbox's ``disk_bytes`` (the size limit: the guest's ext4 cannot grow
beyond it; what it writes is what the file allocates on the host), formatted ext4 on the host
with ``mkfs.ext4`` (~5-20 ms and ~150 KiB allocated for 1 GiB here): no journal (the upper is
thrown away with the sandbox; a paused VM's snapshot holds its page cache, consistent with
the file), no reserved blocks, inode tables initialised lazily, no discard pass. The guest
mounts it ``errors=remount-ro``; the overlay on top is ``volatile`` (no syncs).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from edged.errors import BackendError

MIN_BYTES = 16 << 20  # below this, ext4 leaves no room for anything

MKFS = ("mkfs.ext4", "-q", "-F", "-O", "^has_journal,^resize_inode", "-m", "0",
        "-E", "lazy_itable_init=1,nodiscard", "-L", "sbx-upper")


def make_upper(path: Path, size_bytes: int) -> None:
    """Create the upper disk at ``path`` (must not exist) of ``size_bytes`` apparent size.
    Raises BackendError (mkfs missing or failing, no space) and leaves no file behind."""
    if size_bytes < MIN_BYTES:
        raise BackendError(f"upper disk: {size_bytes} bytes is below {MIN_BYTES}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise BackendError(f"upper disk {path}: {e}") from e
    try:
        try:
            os.ftruncate(fd, size_bytes)
        finally:
            os.close(fd)
        proc = subprocess.run([*MKFS, str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BackendError(f"mkfs.ext4 {path}: {proc.stderr.strip()}")
    except FileNotFoundError as e:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise BackendError("mkfs.ext4 not installed (e2fsprogs)") from e
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise


def allocated_bytes(path: Path) -> int:
    """Host bytes the disk file occupies (its blocks), i.e. what the sandbox wrote plus
    ext4's metadata."""
    return os.stat(path).st_blocks * 512
