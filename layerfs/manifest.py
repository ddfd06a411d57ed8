"""Layer manifests: what the chunk store keeps about one layer.

A manifest names a layer by the sha256 of its EROFS image bytes (``sha256:<hex>``, the OCI
digest convention) and lists, in image order, the fixed-size chunks the image is cut into.
Every chunk but the last is ``chunk_size`` bytes of the image; the last holds the rest.
The manifest is JSON with sorted keys and no insignificant whitespace (canonical), stored
under the layer digest, so the same layer added twice with the same facts gives the same
bytes.

Fields (format 1)::

    {"chunk_size": 1048576,                       # bytes, a power-of-two multiple of 4096
     "chunks": [{"digest": "sha256:...",          # sha256 of the uncompressed chunk
                 "stored_size": 1234}, ...],      # bytes of the zstd file at rest
     "created": "2026-01-02T03:04:05Z",           # RFC 3339, UTC, when it was added
     "digest": "sha256:...",                      # sha256 of the whole image
     "format": 1,
     "kind": "base" | "workspace" | "toolkit",
     "size": 123456789,                           # image bytes
     "source": "dir:/path" | "tar:/path" | ...}   # free text: where it came from
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass
from typing import Any

from layerfs.errors import CorruptError, LayerfsError

FORMAT_VERSION = 1
KINDS = ("base", "workspace", "toolkit")
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 64 << 20  # bounds what a reader ever decompresses for one chunk

_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_CREATED_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


class InvalidArgumentError(LayerfsError, ValueError):
    """A caller passed a value the store cannot take (a bad kind, digest or chunk size)."""


def check_digest(digest: str) -> str:
    """Return ``digest`` if it is ``sha256:`` followed by 64 lowercase hex digits.

    Raises :class:`InvalidArgumentError` (a ``ValueError``) otherwise.
    """
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidArgumentError(f"{digest!r} is not a digest (want sha256:<64 hex digits>)")
    return digest


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is one of :data:`KINDS`, else raise InvalidArgumentError."""
    if kind not in KINDS:
        raise InvalidArgumentError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return kind


def check_chunk_size(size: int) -> int:
    """Return ``size`` if it is a power of two between 4 KiB and 64 MiB (hence a multiple of
    4096, the EROFS block size, so chunk boundaries fall on block boundaries)."""
    if (not isinstance(size, int) or size < MIN_CHUNK_SIZE or size > MAX_CHUNK_SIZE
            or size & (size - 1)):
        raise InvalidArgumentError(
            f"chunk size {size!r} must be a power of two from {MIN_CHUNK_SIZE} to "
            f"{MAX_CHUNK_SIZE} bytes")
    return size


def utc_now_rfc3339() -> str:
    """The current time as RFC 3339 UTC with second precision (``2026-01-02T03:04:05Z``)."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk of a layer: its sha256 (``sha256:<hex>``, of the uncompressed bytes) and
    the size in bytes of its compressed file in the store when the layer was added."""

    digest: str
    stored_size: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """The store's record of one layer (see the module docstring for the fields)."""

    digest: str
    size: int
    chunk_size: int
    chunks: tuple[ChunkRef, ...]
    kind: str
    source: str
    created: str
    format: int = FORMAT_VERSION

    def chunk_length(self, index: int) -> int:
        """Uncompressed bytes of chunk ``index`` (the last one may be short)."""
        if index < len(self.chunks) - 1:
            return self.chunk_size
        return self.size - self.chunk_size * (len(self.chunks) - 1)

    @property
    def stored_size(self) -> int:
        """Compressed bytes of this layer's chunks, each distinct chunk counted once."""
        seen: dict[str, int] = {}
        for c in self.chunks:
            seen.setdefault(c.digest, c.stored_size)
        return sum(seen.values())

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON-ready data."""
        return {
            "chunk_size": self.chunk_size,
            "chunks": [{"digest": c.digest, "stored_size": c.stored_size} for c in self.chunks],
            "created": self.created,
            "digest": self.digest,
            "format": self.format,
            "kind": self.kind,
            "size": self.size,
            "source": self.source,
        }

    def to_json(self) -> bytes:
        """Canonical JSON bytes: sorted keys, compact separators, UTF-8, trailing newline."""
        return (json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate manifest bytes.

        Raises :class:`CorruptError` naming ``where`` if the bytes are not a valid format-1
        manifest (bad JSON, missing or ill-typed field, chunk list inconsistent with
        ``size``), and :class:`InvalidArgumentError` for a newer format this code does not
        know (so it is refused, never misread).
        """
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise CorruptError(f"{where}: not a JSON object")
        fmt = obj.get("format")
        if fmt != FORMAT_VERSION:
            if isinstance(fmt, int) and fmt > FORMAT_VERSION:
                raise InvalidArgumentError(
                    f"{where}: manifest format {fmt} is newer than this layerfs knows "
                    f"({FORMAT_VERSION}); upgrade layerfs")
            raise CorruptError(f"{where}: bad manifest format {fmt!r}")
        try:
            m = cls(
                digest=_field(obj, "digest", str),
                size=_field(obj, "size", int),
                chunk_size=_field(obj, "chunk_size", int),
                chunks=tuple(ChunkRef(_field(c, "digest", str), _field(c, "stored_size", int))
                             for c in _field(obj, "chunks", list)),
                kind=_field(obj, "kind", str),
                source=_field(obj, "source", str),
                created=_field(obj, "created", str),
            )
            check_digest(m.digest)
            check_kind(m.kind)
            check_chunk_size(m.chunk_size)
            for c in m.chunks:
                check_digest(c.digest)
                if c.stored_size < 0:
                    raise ValueError(f"negative stored_size for chunk {c.digest}")
        except (ValueError, TypeError) as exc:
            raise CorruptError(f"{where}: {exc}") from None
        if not _CREATED_RE.fullmatch(m.created):
            raise CorruptError(f"{where}: created {m.created!r} is not RFC 3339 UTC")
        want = -(-m.size // m.chunk_size) if m.size > 0 else 0
        if m.size < 0 or len(m.chunks) != want:
            raise CorruptError(
                f"{where}: {len(m.chunks)} chunks do not cover {m.size} bytes in chunks of "
                f"{m.chunk_size}")
        return m


def _field(obj: Any, name: str, typ: type) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise ValueError(f"missing field {name!r}")
    val = obj[name]
    # bool is an int subclass in Python; a JSON true is never a size.
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise ValueError(f"field {name!r} is {type(val).__name__}, want {typ.__name__}")
    return val
