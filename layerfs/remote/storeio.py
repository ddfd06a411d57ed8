"""Chunk-level access to a :class:`~layerfs.store.Store` for the remotes (server side of a
push, the shared-directory remote).

The store's public API adds whole images; a push arrives chunk by chunk and then a
manifest. These helpers use the store's own atomic writers and lock (its internals, kept
in this one place) so the layout rules stay the store's: chunk files appear whole under
their digest, a manifest is written only once every chunk it lists is durable.

A gc may run between a pushed chunk and its manifest and remove the chunk (nothing
references it yet); :func:`put_manifest` then refuses with the missing chunks and the
pusher sends them again, so a manifest never points at an absent chunk.
"""

from __future__ import annotations

import fcntl
import os

from layerfs.errors import NotFoundError, StoreError
from layerfs.manifest import Manifest, check_digest
from layerfs.remote.base import PushRejectedError, verify_chunk
from layerfs.store import Store, _fsync_dir


def chunk_path(store: Store, digest: str) -> str:
    """Path of the zstd file of chunk ``digest`` in ``store`` (it may not exist)."""
    return store._chunk_path(check_digest(digest)[7:])


def has_chunk(store: Store, digest: str) -> bool:
    """Whether ``store`` holds chunk ``digest``."""
    return os.path.exists(chunk_path(store, digest))


def read_stored(store: Store, digest: str) -> bytes:
    """The zstd frame of chunk ``digest`` exactly as stored (not verified: the reader
    verifies after decompressing). Raises :class:`NotFoundError`."""
    try:
        with open(chunk_path(store, digest), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise NotFoundError(f"chunk {digest} is not in store {store.root}") from None


def put_chunk(store: Store, digest: str, data: bytes) -> bool:
    """Store uncompressed ``data`` as chunk ``digest`` after checking it; True if new.

    Raises :class:`PushRejectedError` if the bytes do not match the digest and
    :class:`StoreError` on I/O failure (ENOSPC for a full disk)."""
    from layerfs.errors import CorruptError

    try:
        verify_chunk(digest, data, f"store {store.root}")
    except CorruptError as exc:
        raise PushRejectedError(str(exc)) from None
    with store._lock(fcntl.LOCK_SH):
        try:
            _, _, new = store._put_chunk(data)
            if new:
                _fsync_dir(os.path.dirname(chunk_path(store, digest)))
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(exc.errno, f"store {store.root}: writing chunk {digest}: "
                                        f"{exc.strerror}") from None
    return bool(new)


def put_manifest(store: Store, m: Manifest) -> bool:
    """Write manifest ``m`` if every chunk it lists is stored; True if it was new.

    Raises :class:`PushRejectedError` with ``missing`` (chunk digests) otherwise."""
    with store._lock(fcntl.LOCK_SH):
        missing = [d for d in dict.fromkeys(c.digest for c in m.chunks)
                   if not has_chunk(store, d)]
        if missing:
            raise PushRejectedError(
                f"layer {m.digest}: {len(missing)} chunk(s) not held, e.g. {missing[0]}",
                missing)
        path = store._manifest_path(m.digest)
        if os.path.exists(path):
            return False
        try:
            store._atomic_write(store._path("manifests"), m.digest[7:] + ".json", m.to_json())
        except OSError as exc:
            raise StoreError(exc.errno, f"store {store.root}: writing manifest {m.digest}: "
                                        f"{exc.strerror}") from None
    return True
