"""The remote interface: where layers come from on a node and go to on a push.

Two kinds of remote hold the same things (manifests by layer digest, chunks by chunk
digest) behind one interface, :class:`Remote`:

- a chunk server (``layerfs serve``) over HTTP, addressed as ``http://HOST:PORT`` or
  ``unix:/path/to.sock`` (:class:`layerfs.remote.http.HttpRemote`);
- a shared directory (an NFS/3FS-style mount) holding a layerfs chunk store, addressed as
  ``file:/path`` or a plain absolute path (:class:`layerfs.remote.directory.DirRemote`).

Every chunk a remote hands out is verified against its digest before it is returned, so a
corrupt remote makes :class:`~layerfs.errors.CorruptError`, never wrong bytes.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Iterable

import zstandard

from layerfs.errors import CorruptError, LayerfsError
from layerfs.manifest import MAX_CHUNK_SIZE, Manifest


class RemoteError(LayerfsError, ConnectionError):
    """A remote could not be reached or answered with a server error. Transient: a
    caller may retry. The message names the remote and what was asked."""


class PushRejectedError(LayerfsError, ValueError):
    """A remote refused what was pushed (a chunk that does not match its digest, a
    manifest whose chunks it does not hold). ``missing`` lists chunk digests the remote
    still needs, if that was the reason."""

    def __init__(self, message: str, missing: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


def verify_chunk(digest: str, data: bytes, where: str, *, length: int | None = None) -> bytes:
    """Return ``data`` if its sha256 is ``digest`` (``sha256:<hex>``) and, when given, its
    length is ``length`` bytes; else raise :class:`CorruptError` naming ``where``."""
    if length is not None and len(data) != length:
        raise CorruptError(f"{where}: chunk {digest} has {len(data)} bytes, want {length}")
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise CorruptError(f"{where}: chunk {digest} does not match its digest")
    return data


def decompress_chunk(digest: str, comp: bytes, where: str) -> bytes:
    """Decompress one zstd chunk frame (at most :data:`MAX_CHUNK_SIZE` bytes out); raises
    :class:`CorruptError` naming ``where`` if it is not a valid frame."""
    try:
        out: bytes = zstandard.ZstdDecompressor().decompress(
            comp, max_output_size=MAX_CHUNK_SIZE)
    except zstandard.ZstdError as exc:
        raise CorruptError(f"{where}: chunk {digest} does not decompress ({exc})") from None
    return out


class Remote(abc.ABC):
    """A place holding layer manifests and chunks (asynchronous; use ``async with``).

    Digests are ``sha256:<hex>``. Lookups of something absent raise
    :class:`~layerfs.errors.NotFoundError`; an unreachable or failing remote raises
    :class:`RemoteError`; bytes that do not match their digest raise
    :class:`~layerfs.errors.CorruptError`.
    """

    url: str

    async def __aenter__(self) -> Remote:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:  # noqa: B027 - most remotes hold nothing to close
        """Release connections."""

    @abc.abstractmethod
    async def manifest(self, digest: str) -> Manifest:
        """The manifest of layer ``digest``, checked to name that layer."""

    @abc.abstractmethod
    async def has_layer(self, digest: str) -> bool:
        """Whether the remote holds the manifest of layer ``digest``."""

    @abc.abstractmethod
    async def chunk(self, digest: str, *, length: int | None = None) -> bytes:
        """The uncompressed bytes of chunk ``digest`` (``length`` bytes when given),
        verified against the digest before they are returned."""

    @abc.abstractmethod
    async def missing_chunks(self, digests: Iterable[str]) -> list[str]:
        """The subset of ``digests`` the remote does not hold, in the given order."""

    @abc.abstractmethod
    async def put_chunk(self, digest: str, data: bytes) -> bool:
        """Store one chunk (uncompressed ``data``); the remote verifies the digest.
        Returns True if it was new. Raises :class:`PushRejectedError` on a mismatch."""

    @abc.abstractmethod
    async def put_manifest(self, manifest: Manifest) -> bool:
        """Store a manifest once every chunk it lists is held. Returns True if new.
        Raises :class:`PushRejectedError` (with ``missing``) otherwise."""
