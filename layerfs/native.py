"""Thin access to the C core (``layerfs._native``) and the one place C errors become
Python exceptions."""

from __future__ import annotations

import errno as _errno
from typing import Any

from layerfs.errors import ImageFormatError, NativeError

try:
    from layerfs import _native  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "layerfs._native is not built: run `pip install -e .` (see README)"
    ) from exc

ffi: Any = _native.ffi
lib: Any = _native.lib


def new_error() -> Any:
    """Allocate a zeroed ``struct lfs_error`` for one C call."""
    return ffi.new("struct lfs_error *")


def raise_error(err: Any, what: str,
                refused: type[Exception] = ImageFormatError) -> None:
    """Raise the exception for a failed C call whose ``struct lfs_error`` is ``err``.

    ``EINVAL`` means refused input and raises ``refused`` (default
    :class:`ImageFormatError`, a ``ValueError``: the writer's); anything else raises
    :class:`NativeError` (an ``OSError``) with the errno kept.
    """
    code = int(err.code) or _errno.EIO
    msg = ffi.string(err.msg).decode("utf-8", "replace")
    if code == _errno.EINVAL:
        raise refused(f"{what}: {msg}")
    if code == _errno.ENOMEM:
        raise MemoryError(f"{what}: {msg}")
    raise NativeError(code, f"{what}: {msg}")


def check(rc: int, err: Any, what: str) -> int:
    """Return ``rc`` if it is non-negative, else raise the error recorded in ``err``."""
    if rc < 0:
        raise_error(err, what)
    return rc
