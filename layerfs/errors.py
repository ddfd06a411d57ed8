"""The exception hierarchy of layerfs.

One base, :class:`LayerfsError`; each subclass also inherits the matching builtin so
callers can catch either way (``except ValueError`` catches a bad tar entry).
"""

from __future__ import annotations


class LayerfsError(Exception):
    """Base of every error raised by layerfs."""


class InvalidSourceError(LayerfsError, ValueError):
    """A source (directory, tar stream, OCI layout) holds something that cannot become a
    layer: a malformed or hostile entry, a truncated archive. The message names the entry."""


class ImageFormatError(LayerfsError, ValueError):
    """The EROFS writer refused its input (a name with ``/`` or NUL, a size out of range)."""


class NativeError(LayerfsError, OSError):
    """An error reported by the C core, with its errno in ``.errno``."""


class StoreError(LayerfsError, OSError):
    """The chunk store could not complete an operation (I/O error, disk full)."""


class NotFoundError(LayerfsError, KeyError):
    """A layer, chunk or image that the store does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; a message reads better
        return str(self.args[0]) if self.args else ""


class CorruptError(StoreError):
    """Stored bytes do not match their digest (a corrupt chunk or manifest)."""
