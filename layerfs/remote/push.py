"""``layerfs push``: copy one layer from a local store to a remote.

Idempotent and resumable: the remote is asked which of the layer's chunks it lacks and
only those are sent (so an interrupted push, run again, sends what is left); the manifest
goes last, and the remote accepts it only once it holds every chunk, so a layer never
appears on the remote incomplete. A layer the remote already has costs one request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from layerfs.remote.base import PushRejectedError, Remote
from layerfs.store import Store


@dataclass(frozen=True, slots=True)
class PushResult:
    """What a push did: chunks (and uncompressed bytes) sent, chunks the remote already
    held, whether the manifest was new there, and the wall time in seconds."""

    digest: str
    sent_chunks: int
    sent_bytes: int
    skipped_chunks: int
    manifest_new: bool
    seconds: float


async def push(store: Store, digest: str, remote: Remote, *, concurrency: int = 8,
               progress: Callable[[int, int], None] | None = None) -> PushResult:
    """Push layer ``digest`` from ``store`` to ``remote``; see the module docstring.

    ``progress(chunks_done, chunks_to_send)`` is called as chunks go. Raises
    :class:`~layerfs.errors.NotFoundError` if the store lacks the layer,
    :class:`~layerfs.errors.CorruptError` if a local chunk is damaged (nothing damaged is
    ever sent), :class:`~layerfs.remote.base.RemoteError` if the remote fails, and
    :class:`~layerfs.remote.base.PushRejectedError` if it refuses.
    """
    t0 = time.monotonic()
    m = await asyncio.to_thread(store.manifest, digest)
    if await remote.has_layer(digest):
        return PushResult(digest, 0, 0, len(m.chunks), False, time.monotonic() - t0)
    distinct = list(dict.fromkeys(c.digest for c in m.chunks))
    sent = sent_bytes = 0
    sem = asyncio.Semaphore(max(1, concurrency))
    for _attempt in range(3):
        missing = await remote.missing_chunks(distinct)
        done = 0

        async def send(cdig: str, total: int) -> None:
            nonlocal done, sent, sent_bytes
            async with sem:
                data = await asyncio.to_thread(store.read_chunk, cdig)  # verified
                await remote.put_chunk(cdig, data)
            sent += 1
            sent_bytes += len(data)
            done += 1
            if progress is not None:
                progress(done, total)

        await asyncio.gather(*(send(c, len(missing)) for c in missing))
        try:
            new = await remote.put_manifest(m)
        except PushRejectedError as exc:
            # A gc on the remote may remove chunks pushed moments ago (no manifest yet
            # references them): send what it names again.
            if exc.missing:
                continue
            raise
        return PushResult(digest, sent, sent_bytes, len(distinct) - sent, new,
                          time.monotonic() - t0)
    raise PushRejectedError(f"push {digest} to {remote.url}: the remote keeps losing chunks")
