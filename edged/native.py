"""Thin access to edged's part of the C core (``edged._native``: confinement, seccomp,
memory advice) and the one place its C errors become edged exceptions.

``EINVAL`` (input the C side refuses: a malformed Landlock blob, a bad seccomp rule) is a
:class:`~edged.errors.BadRequest` (a ``ValueError``), ``ENOMEM`` a :class:`MemoryError`,
anything else a :class:`~edged.errors.BackendError` (an ``OSError``) with ``errno`` kept.
"""

from __future__ import annotations

import errno as _errno
from typing import Any, NoReturn

from edged.errors import BackendError, BadRequest

try:
    from edged import _native  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError("edged._native is not built: run `pip install -e .` (see README)") from exc

ffi: Any = _native.ffi
lib: Any = _native.lib


def new_error() -> Any:
    """Allocate a zeroed ``struct lfs_error`` for one C call."""
    return ffi.new("struct lfs_error *")


def raise_error(err: Any, what: str) -> NoReturn:
    """Raise the exception for a failed C call whose ``struct lfs_error`` is ``err``."""
    code = int(err.code) or _errno.EIO
    msg = f"{what}: {ffi.string(err.msg).decode('utf-8', 'replace')}"
    if code == _errno.EINVAL:
        raise BadRequest(msg)
    if code == _errno.ENOMEM:
        raise MemoryError(msg)
    exc = BackendError(msg)
    exc.errno = code
    raise exc


def check(rc: int, err: Any, what: str) -> int:
    """Return ``rc`` if it is non-negative, else raise the error recorded in ``err``."""
    if rc < 0:
        raise_error(err, what)
    return rc


__all__ = ["check", "ffi", "lib", "new_error", "raise_error"]
