"""Thin access to the C core (``layerfs._native``) and the one place C errors become
Python exceptions.

A build from a directory imports this, :mod:`layerfs.writer` and
:mod:`layerfs.sources.directory` only, none of which imports :mod:`typing` when it
runs: ``typing`` (with ``re``, ``enum``, ``contextlib``) cost ~16 ms of CPU at start-up
(``perf stat -r 20``, against ~16 ms for the bare interpreter), which no build needs.
They take ``TYPE_CHECKING`` from here (False; mypy takes any ``TYPE_CHECKING`` as
true) and :func:`named_tuple` for their records.
"""

from __future__ import annotations

import errno as _errno

from layerfs.errors import ImageFormatError, NativeError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _T = TypeVar("_T")

    def named_tuple(cls: _T) -> _T:
        """(for mypy: the class as written, a ``typing.NamedTuple``)"""
        return cls
else:
    def named_tuple(cls):
        """A class written as a ``typing.NamedTuple`` subclass (fields as annotations,
        defaults after them, a docstring; methods are not carried), made with
        :func:`collections.namedtuple` instead, so that :mod:`typing` is not imported
        when this runs. Its base must be ``NamedTuple`` from the ``TYPE_CHECKING``
        block, ``object`` at run time."""
        from collections import namedtuple

        fields = list(cls.__annotations__)
        defaults = [cls.__dict__[f] for f in fields if f in cls.__dict__]
        made = namedtuple(cls.__name__, fields, defaults=defaults, module=cls.__module__)
        made.__doc__ = cls.__doc__
        made.__qualname__ = cls.__qualname__
        return made

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
