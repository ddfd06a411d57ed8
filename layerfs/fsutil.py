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


def write_replace(path: str, data: bytes, *, tmp_dir: str, prefix: str) -> None:
    """Replace the file ``path`` with ``data`` so that it is never seen torn: write a temp
    file named ``prefix``... in ``tmp_dir`` (on ``path``'s filesystem), fsync it, rename it
    onto ``path``. The temp file is removed on any error. The rename itself is durable only
    once ``path``'s directory is fsynced (:func:`atomic_write` does; the chunk store fsyncs
    the chunks' directories itself, once per batch)."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=tmp_dir)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(directory: str, name: str, data: bytes, *, tmp_dir: str) -> None:
    """Replace ``directory/name`` with ``data`` so that a crash leaves the old file or the
    new one, never a torn one: :func:`write_replace`, then fsync ``directory``."""
    write_replace(os.path.join(directory, name), data, tmp_dir=tmp_dir, prefix=name + ".")
    fsync_dir(directory)
