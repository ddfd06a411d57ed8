"""A shared directory (an NFS/3FS-style mount) holding a layerfs chunk store, as a remote.

Reads go through :class:`~layerfs.store.Store` (every chunk re-hashed); writes use the
store's atomic writers (:mod:`layerfs.remote.storeio`), so several nodes may push to and
read from the same directory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable

from layerfs.errors import StoreError
from layerfs.manifest import Manifest, check_digest
from layerfs.remote import storeio
from layerfs.remote.base import Remote, RemoteError, decompress_chunk, verify_chunk
from layerfs.store import Store


class DirRemote(Remote):
    """The chunk store at ``path`` as a remote. ``create``: make the store layout if the
    directory is empty (for a push target); otherwise a missing store raises
    :class:`~layerfs.errors.NotFoundError` on first use."""

    def __init__(self, path: str, *, create: bool = False) -> None:
        self.url = "file:" + os.path.abspath(path)
        self._path = os.path.abspath(path)
        self._create = create
        self._store: Store | None = None

    def _st(self) -> Store:
        if self._store is None:
            try:
                self._store = Store(self._path, create=self._create)
            except StoreError as exc:
                raise RemoteError(f"remote {self.url}: {exc}") from None
        return self._store

    async def manifest(self, digest: str) -> Manifest:
        return await asyncio.to_thread(lambda: self._st().manifest(check_digest(digest)))

    async def has_layer(self, digest: str) -> bool:
        check_digest(digest)
        return await asyncio.to_thread(lambda: self._st().has_layer(digest))

    async def chunk(self, digest: str, *, length: int | None = None) -> bytes:
        def load() -> bytes:
            comp = storeio.read_stored(self._st(), digest)
            data = decompress_chunk(digest, comp, f"remote {self.url}")
            return verify_chunk(digest, data, f"remote {self.url}", length=length)
        return await asyncio.to_thread(load)

    async def missing_chunks(self, digests: Iterable[str]) -> list[str]:
        want = list(digests)
        return await asyncio.to_thread(
            lambda: [d for d in want if not storeio.has_chunk(self._st(), d)])

    async def put_chunk(self, digest: str, data: bytes) -> bool:
        return await asyncio.to_thread(storeio.put_chunk, self._st(), digest, data)

    async def put_manifest(self, manifest: Manifest) -> bool:
        return await asyncio.to_thread(storeio.put_manifest, self._st(), manifest)
