"""sha256 digests of image files, the store's and the CLI's layer identity.

Small on purpose: ``layerfs build --no-store`` needs the digest but not the store
(zstandard, a thread pool), so this module imports only ``hashlib`` and ``mmap``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable

__all__ = ["sha256_fd", "sha256_file", "sha256_while"]


_WINDOW = 8 << 20  # bytes mapped at a time: the peak RSS stays small for any image


def sha256_fd(fd: int) -> str:
    """``sha256:<hex>`` of the whole regular file open at ``fd`` (its position is not
    used or moved). The file is mapped 8 MiB at a time and each window hashed in one
    call: no copy into Python buffers (0.17 s of CPU against 0.20 s for 1 MiB reads of
    a 225 MB image, OpenSSL), and the GIL is released meanwhile; read in 1 MiB blocks
    where the file cannot be mapped. Raises ``OSError``."""
    size = os.fstat(fd).st_size
    h = hashlib.sha256()
    off = 0
    try:
        while off < size:  # mmap refuses an empty file: none for size 0
            with mmap.mmap(fd, min(_WINDOW, size - off), access=mmap.ACCESS_READ,
                           offset=off) as m:
                h.update(m)
            off += _WINDOW
    except OSError:  # a filesystem without mmap (ENODEV, e.g. FUSE direct I/O): read
        while block := os.pread(fd, 1 << 20, off):
            h.update(block)
            off += len(block)
    return "sha256:" + h.hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """``sha256:<hex>`` of the file at ``path`` (see :func:`sha256_fd`)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return sha256_fd(fd)
    finally:
        os.close(fd)


def sha256_while(fd: int, work: Callable[[int], None]) -> str:
    """``sha256:<hex>`` of the file open at ``fd`` (see :func:`sha256_fd`), hashed while
    another thread runs ``work(fd)`` (e.g. its fsync: both wait in C without the GIL,
    so a durable build pays the longer of the two, not their sum). An exception of
    ``work`` is raised here, after the hash."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work(fd)
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    t = threading.Thread(target=run, name="layerfs-digest-sync", daemon=True)
    t.start()
    try:
        digest = sha256_fd(fd)
    finally:
        t.join()
    if failed:
        raise failed[0]
    return digest
