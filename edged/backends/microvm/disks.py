"""A microVM's writable disk: the sandbox's overlay upper.

A sparse file of the sandbox's ``disk_bytes`` (the size limit: the guest's ext4 cannot grow
beyond it; what it writes is what the file allocates on the host), formatted ext4 on the host
with ``mkfs.ext4`` (~5-20 ms and ~150 KiB allocated for 1 GiB here): no journal (the upper is
thrown away with the sandbox; a paused VM's snapshot holds its page cache, consistent with
the file), no reserved blocks, inode tables initialised lazily, no discard pass. The guest
mounts it ``errors=remount-ro``; the overlay on top is ``volatile`` (no syncs).

A template clone's upper is not made here but copied (:func:`copy_upper`) from its
template's, which the template's guest mounted before it was saved: the clone's guest has it
mounted already (the ext4 mount is ~40% of a clone's mounts under TCG), and its file must
be what that guest's page cache says it is, i.e. the template's as the template left it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
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


def data_extents(fd: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` byte offsets of each data extent of the open file ``fd``, in order
    (``SEEK_DATA``/``SEEK_HOLE``: a hole is skipped; a file system without holes reports one
    extent, the whole file). Raises OSError."""
    size = os.fstat(fd).st_size
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole is left
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        off = end


def copy_upper(src: Path, dst: Path) -> None:
    """Copy the upper disk ``src`` (a template's, as its guest left it mounted) to ``dst``
    (must not exist): the same apparent size, its data extents only (holes stay holes:
    ~0.3 MiB of a 1 GiB disk). Raises BackendError and leaves no file behind."""
    try:
        with open(src, "rb", buffering=0) as f:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, os.fstat(f.fileno()).st_size)
                for start, end in data_extents(f.fileno()):
                    while start < end:
                        n = os.copy_file_range(f.fileno(), fd, end - start, start, start)
                        if n <= 0:
                            raise OSError(f"copy_file_range returned {n} at {start}")
                        start += n
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    dst.unlink()
                raise
            os.close(fd)
    except OSError as e:
        raise BackendError(f"upper disk {dst} from {src}: {e}") from e


def allocated_bytes(path: Path) -> int:
    """Host bytes the disk file occupies (its blocks), i.e. what the sandbox wrote plus
    ext4's metadata."""
    return os.stat(path).st_blocks * 512
