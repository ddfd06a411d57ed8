"""Writing a result (an image) to a path the user named, or to stdout.

Rule for every ``-o``/``out`` path of layerfs (build, export, :func:`write_image`):

- nothing there yet, or a regular file: the result is written to a temp file in the same
  directory and renamed over the path, so readers see the old file or the whole new one;
- anything else there (a directory, a symlink even to a regular file, a character or
  block device such as ``/dev/null``, a FIFO, a socket) is refused before any work with
  an :class:`OutputError` naming the user's path, and left exactly as it was (a rename
  would replace the device node or the link itself, not write through it);
- ``-`` means stdout (:data:`STDOUT`), refused when stdout is a terminal.

Files are created with mode ``0644`` minus the process umask, like any file a command
creates.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from typing import BinaryIO

from layerfs.errors import LayerfsError

__all__ = [
    "STDOUT",
    "OutputError",
    "atomic_output",
    "check_output",
    "copy_to_stdout",
    "file_mode",
    "make_durable",
    "replace_with",
]

STDOUT = "-"

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


class OutputError(LayerfsError, ValueError):
    """An output path that layerfs refuses to write: it exists and is not a regular
    file, or it is stdout on a terminal. The message names the path as given."""


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def check_output(path: str | os.PathLike[str], *, stdout: BinaryIO | None = None) -> None:
    """Raise :class:`OutputError` unless ``path`` may be written by the rule above.

    ``path`` ``"-"`` checks ``stdout`` (default ``sys.stdout.buffer``) is not a TTY.
    Raises :class:`FileNotFoundError` naming ``path`` if its directory does not exist.
    """
    p = os.fspath(path)
    if p == STDOUT:
        out = stdout if stdout is not None else sys.stdout.buffer
        if out.isatty():
            raise OutputError("-o -: stdout is a terminal; refusing to write a binary "
                              "image there (redirect it to a file or a pipe)")
        return
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(parent):
            raise FileNotFoundError(2, f"{p}: directory {parent} does not exist") from None
        return
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{p}: exists and is {_kind(st.st_mode)}; refusing to replace it "
                          f"(an output path must be a new or a regular file)")


def file_mode() -> int:
    """``0o644`` minus the process umask (read from ``/proc/self/status``, so the umask
    is never changed, even for a moment, in a threaded process)."""
    umask = 0o022
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"Umask:"):
                umask = int(line.split()[1], 8)
                break
    return 0o644 & ~umask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[int]:
    """Yield a writable, seekable fd of a temp file beside ``path``; on a clean exit it
    is handed to :func:`replace_with`. On an exception the
    temp file is removed and ``path`` is untouched. The fd is closed by this function.

    Raises :class:`OutputError` (see :func:`check_output`), before anything is created.
    """
    import tempfile  # here, not at the top: a build into an fd never needs it

    p = os.fspath(path)
    if p == STDOUT:
        raise OutputError("-o -: this operation cannot write to stdout")
    check_output(p)
    dest = os.path.abspath(p)
    where = os.path.dirname(dest)
    fd, tmp = tempfile.mkstemp(prefix=".layerfs-", suffix=".tmp", dir=where)
    try:
        try:
            yield fd
        finally:
            os.close(fd)
        replace_with(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def make_durable(fd: int) -> None:
    """Give the finished temp file open at ``fd`` mode :func:`file_mode` and fsync it
    (what :func:`replace_with` does first, for a caller that does it meanwhile)."""
    os.fchmod(fd, file_mode())
    os.fsync(fd)


def replace_with(tmp: str, path: str | os.PathLike[str], *, durable: bool = False) -> None:
    """Give the finished file ``tmp`` (in the same directory as ``path``) mode
    :func:`file_mode`, make it durable (both skipped with ``durable``: the caller ran
    :func:`make_durable` on it) and rename it over ``path``, which is checked again
    with :func:`check_output` just before (it may have been replaced since the work
    began: a rename must never replace a device or a link that appeared meanwhile). On
    error ``tmp`` is left for the caller to remove."""
    p = os.fspath(path)
    dest = os.path.abspath(p)
    if not durable:
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            make_durable(fd)
        finally:
            os.close(fd)
    check_output(p)
    os.rename(tmp, dest)
    dfd = os.open(os.path.dirname(dest), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def copy_to_stdout(src: str | os.PathLike[str], *, stdout: BinaryIO | None = None) -> None:
    """Copy the file ``src`` to ``stdout`` (default ``sys.stdout.buffer``), refusing a
    terminal (:class:`OutputError`)."""
    import shutil

    out = stdout if stdout is not None else sys.stdout.buffer
    check_output(STDOUT, stdout=out)
    out.flush()
    with open(src, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)
    out.flush()
