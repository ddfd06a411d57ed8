"""Small durable-file helpers shared by the chunk store and the node cache."""

from __future__ import annotations

import contextlib
import os
import tempfile


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` so that renames and creations in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def atomic_write(directory: str, name: str, data: bytes, *, tmp_dir: str) -> None:
    """Replace ``directory/name`` with ``data`` so that a crash leaves the old file or the
    new one, never a torn one: write a temp file in ``tmp_dir`` (same filesystem), fsync it,
    rename it into place, fsync ``directory``. The temp file is removed on any error."""
    fd, tmp = tempfile.mkstemp(prefix=name + ".", dir=tmp_dir)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
