"""The server side of a push and the shared-directory remote, over the store's public
chunk-level API (:meth:`~layerfs.store.Store.put_chunk`,
:meth:`~layerfs.store.Store.put_manifest`), with the store's refusals turned into the
remote protocol's :class:`~layerfs.remote.base.PushRejectedError`.
"""

from __future__ import annotations

from layerfs.manifest import Manifest
from layerfs.remote.base import PushRejectedError
from layerfs.store import RejectedError, Store


def has_chunk(store: Store, digest: str) -> bool:
    """Whether ``store`` holds chunk ``digest``."""
    return store.has_chunk(digest)


def read_stored(store: Store, digest: str) -> bytes:
    """The zstd frame of chunk ``digest`` exactly as stored (not verified: the reader
    verifies after decompressing). Raises :class:`~layerfs.errors.NotFoundError`."""
    return store.read_stored_chunk(digest)


def read_stored_cached(store: Store, digest: str) -> bytes | None:
    """Like :func:`read_stored` if the chunk's file is wholly in the page cache, else
    None (without waiting for the disk)."""
    return store.read_stored_chunk_nowait(digest)


def put_chunk(store: Store, digest: str, data: bytes) -> bool:
    """Store uncompressed ``data`` as chunk ``digest`` after checking it; True if new.

    Raises :class:`PushRejectedError` if the bytes do not match the digest and
    :class:`~layerfs.errors.StoreError` on I/O failure (ENOSPC for a full disk)."""
    try:
        return store.put_chunk(digest, data)
    except RejectedError as exc:
        raise PushRejectedError(str(exc)) from None


def put_manifest(store: Store, m: Manifest) -> bool:
    """Write manifest ``m`` if every chunk it lists is stored; True if it was new.

    Raises :class:`PushRejectedError` with ``missing`` (chunk digests) otherwise."""
    try:
        return store.put_manifest(m)
    except RejectedError as exc:
        raise PushRejectedError(str(exc), exc.missing) from None
