"""The lazy layer server process: the C FUSE file server (csrc/lib/lazy.c) plus the
Python side that fetches chunks.

Run by the supervisor (:mod:`layerfs.lazy.supervisor`) as
``python -m layerfs.lazy.server --cache DIR --fuse-fd N [--resumed]``, with the /dev/fuse
fd inherited. The C side answers cached reads itself and queues each missing chunk once;
this process wakes on the C side's eventfd, fetches the chunk from the layer's remote
(aiohttp or a shared directory), verifies it against its digest, writes it to the cache
atomically and hands it back to C, which answers every read parked on it.

Faults. A remote that fails or is slow is retried with exponential backoff (50 ms doubling
to 2 s) until ``fetch_timeout`` seconds have passed since the read asked for the chunk;
then the waiting reads get EIO and one log line names the layer, chunk and remote; for
:data:`FAIL_HOLD` seconds after that, reads of the chunk fail at once. A chunk
that does not match its digest is discarded and fetched again, never served. A full cache
disk evicts unneeded chunks and retries once, then fails the reads with EIO and logs
ENOSPC; a chunk whose write failed is never marked present.

Control: an HTTP/JSON API on ``ROOT/control.sock`` (see :mod:`layerfs.lazy.client`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import resource
import sys
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from layerfs.errors import CorruptError, LayerfsError, NotFoundError
from layerfs.lazy.cache import ChunkCache
from layerfs.manifest import Manifest, check_digest
from layerfs.native import check, ffi, lib, new_error
from layerfs.remote.base import Remote, RemoteError, verify_chunk
from layerfs.remote.connect import open_remote

log = logging.getLogger("layerfs.lazy")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the fetch latency histogram; one more bucket is +Inf."""


FAIL_HOLD = 1.0
"""Seconds during which a chunk whose fetch just failed fails again at once."""

DEFAULT_SPECULATE = 1
"""Chunks fetched ahead of a sequential miss. Measured on the cold-start bench (256 KiB
chunks): one chunk ahead is read by a later read 3 times out of 4 and adds ~0.3% of the
image to what is fetched; two ahead add twice the waste for few more hits."""

SPECULATIVE_INFLIGHT = 2
"""Speculative fetches in flight at once (they never hold up fetches reads wait for
beyond this)."""

FLUSH_DELAY = 1.0
"""Seconds a changed present bitmap may wait before it is persisted. A flush (fdatasync of
the layer file, then the bitmap's atomic write) blocks the loop for ~10 ms here; once a
second keeps that off cold reads, and a crash costs at most a second of refetches."""


class FetchFailed(LayerfsError, OSError):
    """A chunk could not be fetched within the bound."""


@dataclass
class Layer:
    """One registered layer and its Python-side metrics."""

    digest: str
    slot: int
    remote: str
    manifest: Manifest
    bytes_fetched: int = 0
    chunks_fetched: int = 0
    corrupt: int = 0
    fetch_failures: int = 0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    @property
    def name(self) -> str:
        return self.digest[7:] + ".erofs"

    def observe(self, seconds: float, nbytes: int) -> None:
        self.latency_counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds
        self.bytes_fetched += nbytes
        self.chunks_fetched += 1


class LazyServer:
    """The Python side of the lazy file server; see the module docstring.

    ``fetch_timeout``: seconds after which a read waiting for a chunk fails with EIO.
    ``attempt_timeout``: seconds one request to a remote may take. ``concurrency``:
    fetches in flight at once. ``cache_limit``: bytes the cache may hold (LRU eviction of
    chunks no read is using), ``None`` for no limit. ``speculate``: chunks fetched ahead
    when a read misses chunk i while chunk i-1 is present or being fetched (a reader
    going through the image in order), 0 for none; at most :data:`SPECULATIVE_INFLIGHT`
    of those are fetched at once, after the fetches reads wait for.
    """

    def __init__(self, cache: ChunkCache, fuse_fd: int, *, resumed: bool = False,
                 fetch_timeout: float = 30.0, attempt_timeout: float = 10.0,
                 concurrency: int = 8, max_threads: int = 8,
                 speculate: int = DEFAULT_SPECULATE) -> None:
        self.cache = cache
        self.fuse_fd = fuse_fd
        self.resumed = resumed
        self.fetch_timeout = fetch_timeout
        self.attempt_timeout = attempt_timeout
        self.max_threads = max_threads
        self.speculate = max(0, speculate)
        self.layers: dict[str, Layer] = {}
        self.by_slot: dict[int, Layer] = {}
        self._concurrency = concurrency
        self._remotes: dict[str, Remote] = {}
        self._flights: dict[str, asyncio.Task[bytes]] = {}
        self._failed: dict[str, float] = {}  # chunk digest -> loop time it failed
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ondemand = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()
        self._cache_bytes = 0
        self._orphans: dict[str, int] = {}  # unregistered layer -> bytes of its file
        self._dirty: set[str] = set()
        self._flush_handle: asyncio.TimerHandle | None = None
        self._holder_maps: dict[str, dict[str, list[int]]] = {}
        self._slots_high = 0  # every slot handed out on this connection is below it
        self.lz: Any = None

    # -- start-up -----------------------------------------------------------------------

    def start(self) -> None:
        """Create the C server, restore registered layers and present chunks, start the
        FUSE loop and watch the fetch queue. Call from inside the event loop."""
        self._sem = asyncio.Semaphore(self._concurrency)
        self._spec_sem = asyncio.Semaphore(SPECULATIVE_INFLIGHT)
        err = new_error()
        lz = lib.lfs_lazy_new(self.fuse_fd, 1 if self.resumed else 0, err)
        if lz == ffi.NULL:
            check(-1, err, "lazy server")
        # Freed with this object (lfs_lazy_free leaves one whose FUSE loop still runs alone:
        # its threads use it until the connection ends).
        lz = ffi.gc(lz, lib.lfs_lazy_free)
        self.lz = lz
        lib.lfs_lazy_set_speculate(lz, self.speculate)
        records = self.cache.layers()
        high = self.cache.slots_high()
        if high is None:  # a cache from before the mark was kept
            high = max((int(r["slot"]) + 1 for r in records.values()), default=0)
        if self.resumed:
            # The kernel may hold inodes of any slot the dead server handed out (all
            # below the mark), with lookup counts this server never saw: never give
            # those slots to another layer in this one.
            for s in range(min(high, lib.LFS_LAZY_MAX_LAYERS)):
                lib.lfs_lazy_pin_slot(lz, s)
        else:  # a fresh connection: the kernel holds nothing
            high = 0
        for digest, rec in records.items():
            if rec.get("removed"):
                continue
            try:
                m = Manifest.from_json(str(rec["manifest"]).encode(),
                                       where=f"cache layer {digest}")
                self._add(Layer(digest, int(rec["slot"]), str(rec["remote"]), m))
            except (LayerfsError, KeyError, ValueError, TypeError, OverflowError) as exc:
                # Never a reason not to start (the server would restart into it for
                # ever): the layer is registered again when next asked for.
                log.error("layer %s: cannot restore its registration (%s); dropped",
                          digest, exc)
                with contextlib.suppress(OSError, LayerfsError):
                    self.cache.drop_layer(digest)
                continue
            high = max(high, int(rec["slot"]) + 1)
        self._slots_high = high
        try:
            self.cache.save_slots_high(high)
        except (OSError, LayerfsError) as exc:
            # Start anyway (mounts depend on this server); a registration that needs a
            # higher mark fails until it can be saved.
            log.warning("cache %s: cannot save the slot mark (%s)", self.cache.root, exc)
        for digest in self.cache.cached_layers():
            if digest not in self.layers:
                # Unregistered layers' files: the first to go when space is needed.
                self._orphans[digest] = self.cache.data_bytes(digest)
        self._cache_bytes += sum(self._orphans.values())
        check(lib.lfs_lazy_start(self.lz, self.max_threads, err), err, "lazy server start")
        if self.resumed:
            # Pinned slots whose inodes the kernel no longer has are free at once (a
            # FORGET would never come for them).
            freed = lib.lfs_lazy_unpin_forgotten(self.lz)
            if freed:
                log.info("%d slot(s) of the previous server are free again", freed)
        asyncio.get_running_loop().add_reader(lib.lfs_lazy_event_fd(self.lz), self._on_event)
        log.info("lazy server pid %d: %d layer(s), %d bytes cached%s", os.getpid(),
                 len(self.layers), self._cache_bytes, ", resumed" if self.resumed else "")

    def _add(self, layer: Layer) -> None:
        err = new_error()
        m = layer.manifest
        check(lib.lfs_lazy_add_layer(self.lz, layer.slot, layer.name.encode(), m.size,
                                     m.chunk_size,
                                     self.cache.data_path(layer.digest).encode(), err),
              err, f"layer {layer.digest}")
        self.layers[layer.digest] = layer
        self.by_slot[layer.slot] = layer
        orphan = self._orphans.pop(layer.digest, None)
        if orphan is not None:
            self._cache_bytes -= orphan
        try:
            bits = self.cache.load_present(layer.digest, m.size, m.chunk_size, len(m.chunks))
            for i in range(len(m.chunks)):
                if bits[i >> 3] >> (i & 7) & 1 and \
                        lib.lfs_lazy_chunk_claim(self.lz, layer.slot, i) == 1:
                    check(lib.lfs_lazy_chunk_ready(self.lz, layer.slot, i, err), err,
                          f"layer {layer.digest}")
                    self._cache_bytes += m.chunk_length(i)
        except BaseException:
            self._remove(layer)
            if orphan is not None:
                self._orphans[layer.digest] = orphan
                self._cache_bytes += orphan
            raise

    def _remote(self, url: str) -> Remote:
        r = self._remotes.get(url)
        if r is None:
            r = self._remotes[url] = open_remote(url, timeout=self.attempt_timeout) \
                if not url.startswith(("file:", "/")) else open_remote(url)
        return r

    async def register(self, digest: str, remote: str) -> Layer:
        """Expose layer ``digest`` (manifest from ``remote``) as ``<hex>.erofs``.
        Idempotent. Raises NotFoundError/RemoteError from the remote."""
        check_digest(digest)
        if digest in self.layers:
            return self.layers[digest]
        m = await self._remote(remote).manifest(digest)
        if digest in self.layers:  # registered while we waited
            return self.layers[digest]
        slot = lib.lfs_lazy_take_slot(self.lz)
        if slot < 0:
            raise LayerfsError(f"layer {digest}: every one of the {lib.LFS_LAZY_MAX_LAYERS} "
                               "layer slots is in use (unregister unused layers)")
        if slot >= self._slots_high:
            # Durable before the kernel can see the slot: a restarted server pins
            # every slot below the mark.
            self.cache.save_slots_high(slot + 1)
            self._slots_high = slot + 1
        layer = Layer(digest, slot, remote, m)
        self._add(layer)  # a failure leaves the slot free and nothing recorded
        try:
            self.cache.save_layer(digest, {"slot": layer.slot, "remote": remote,
                                           "manifest": m.to_json().decode()})
        except BaseException:
            self._remove(layer)
            raise
        log.info("registered layer %s (%d bytes, %d chunks) from %s in slot %d",
                 digest, m.size, len(m.chunks), remote, layer.slot)
        return layer

    def unregister(self, digest: str) -> None:
        """Remove layer ``digest``'s file (reads of it fail with EIO from now on). Raises
        NotFoundError, or OSError/LayerfsError if its record cannot be updated (it then
        stays registered)."""
        layer = self.layers.get(digest)
        if layer is None:
            raise NotFoundError(f"layer {digest} is not registered")
        with contextlib.suppress(LayerfsError):
            self._flush_present(layer)
        # Recorded first: a layer whose record cannot change stays registered as is.
        self.cache.save_layer(digest, {"slot": layer.slot, "removed": True})
        self._remove(layer)
        # The slot is reused once the kernel has forgotten the file (lfs_lazy_take_slot);
        # the cache file stays for a later registration, first in line for eviction.
        self._orphans[digest] = self.cache.data_bytes(digest)
        self._cache_bytes += self._orphans[digest]

    def _remove(self, layer: Layer) -> None:
        """Take ``layer`` out of the C server and of the cache's accounting."""
        # Its present chunks, counted while C still has them (removal forgets them).
        self._cache_bytes -= sum(layer.manifest.chunk_length(i)
                                 for i in range(len(layer.manifest.chunks))
                                 if self._present(layer, i))
        del self.layers[layer.digest]
        del self.by_slot[layer.slot]
        self._dirty.discard(layer.digest)
        lib.lfs_lazy_remove_layer(self.lz, layer.slot, new_error())

    def _live(self, layer: Layer) -> bool:
        """Whether ``layer`` is still registered. A fetch started for a layer that was
        unregistered meanwhile must not touch its slot: another layer may hold it."""
        return self.by_slot.get(layer.slot) is layer

    def _present(self, layer: Layer, index: int) -> bool:
        return bool(lib.lfs_lazy_chunk_info(self.lz, layer.slot, index, ffi.NULL)
                    == lib.LFS_LAZY_PRESENT)

    # -- the present bitmaps --------------------------------------------------------------

    def _flush_present(self, layer: Layer) -> None:
        m = layer.manifest
        buf = ffi.new("uint8_t[]", max(1, (len(m.chunks) + 7) // 8))
        n = lib.lfs_lazy_present_bitmap(self.lz, layer.slot, buf, len(buf))
        if n < 0:
            return
        # Snapshot, flush, write: every chunk the bitmap names was written before the
        # flush, so the bitmap on disk never names bytes a crash could lose.
        err = new_error()
        check(lib.lfs_lazy_layer_sync(self.lz, layer.slot, err), err, f"layer {layer.digest}")
        self.cache.save_present(layer.digest, m.size, m.chunk_size, n,
                                bytes(ffi.buffer(buf, (n + 7) // 8)))

    def _mark_dirty(self, layer: Layer) -> None:
        """Persist the layer's bitmap soon: at most every :data:`FLUSH_DELAY` seconds (one
        fdatasync for every chunk written meanwhile); a lagging bitmap only means a
        refetch after a crash."""
        self._dirty.add(layer.digest)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_DELAY,
                                                                       self._flush_dirty)

    def _flush_dirty(self) -> None:
        self._flush_handle = None
        dirty, self._dirty = self._dirty, set()
        for digest in dirty:
            layer = self.layers.get(digest)
            if layer is None:
                continue
            try:
                self._flush_present(layer)
            except LayerfsError as exc:
                log.warning("layer %s: %s (its chunks will be refetched after a restart)",
                            digest, exc)

    # -- fetching -----------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _on_event(self) -> None:
        slot = ffi.new("uint32_t *")
        idx = ffi.new("uint32_t *")
        while (kind := lib.lfs_lazy_next_fetch(self.lz, slot, idx)) > 0:
            layer = self.by_slot.get(int(slot[0]))
            if layer is None or idx[0] >= len(layer.manifest.chunks):
                lib.lfs_lazy_chunk_failed(self.lz, slot[0], idx[0], errno.EIO)
                continue
            if kind == 2:  # speculative: on-demand ones were popped first
                self._spawn(self._speculative(layer, int(idx[0])))
                continue
            self._ondemand += 1
            self._idle.clear()
            self._spawn(self._fetch(layer, int(idx[0]), ondemand=True))
        if lib.lfs_lazy_stopped(self.lz):
            self._stop.set()

    async def _fetch(self, layer: Layer, index: int, *, ondemand: bool) -> None:
        ref = layer.manifest.chunks[index]
        try:
            now = asyncio.get_running_loop().time()
            if now - self._failed.get(ref.digest, -1e9) < FAIL_HOLD:
                # The kernel retries a page synchronously right after its readahead
                # failed; without this the reader would wait out the bound twice.
                if self._live(layer):
                    lib.lfs_lazy_chunk_failed(self.lz, layer.slot, index, errno.EIO)
                return
            try:
                data = await self._get_chunk(layer, index)
                if self._live(layer):
                    await self._write(layer, index, data)
            except FetchFailed as exc:
                layer.fetch_failures += 1
                self._failed[ref.digest] = asyncio.get_running_loop().time()
                log.error("%s", exc)
                if self._live(layer):
                    lib.lfs_lazy_chunk_failed(self.lz, layer.slot, index, errno.EIO)
        finally:
            if ondemand:
                self._ondemand -= 1
                if self._ondemand == 0:
                    self._idle.set()

    async def _speculative(self, layer: Layer, index: int) -> None:
        async with self._spec_sem:
            await self._fetch(layer, index, ondemand=False)

    async def _write(self, layer: Layer, index: int, data: bytes) -> None:
        """Write a verified chunk into the layer's cache file through C (durable, then
        present); on ENOSPC evict and retry once. Raises :class:`FetchFailed`."""
        ref = layer.manifest.chunks[index]
        for attempt in (1, 2):
            err = new_error()
            # On the loop, not in a thread: a pwrite into the page cache (no flush here,
            # see _flush_present) costs less than the thread hop.
            rc = lib.lfs_lazy_chunk_write(self.lz, layer.slot, index, data, len(data), err)
            if rc == 0:
                self._cache_bytes += len(data)
                self._mark_dirty(layer)
                if self.cache.limit is not None and self._cache_bytes > self.cache.limit:
                    self.evict(self.cache.limit)
                return
            code, msg = int(err.code), ffi.string(err.msg).decode()
            if code == errno.ENOSPC and attempt == 1:
                self.evict(max(0, self._cache_bytes - 4 * layer.manifest.chunk_size))
                continue
            what = "disk full (ENOSPC)" if code == errno.ENOSPC else msg
            raise FetchFailed(code, f"layer {layer.digest} chunk {index} ({ref.digest}): "
                                    f"cache {self.cache.root}: {what}")

    async def _get_chunk(self, layer: Layer, index: int) -> bytes:
        digest = layer.manifest.chunks[index].digest
        t = self._flights.get(digest)
        if t is None:
            # Layers sharing a chunk share its one fetch.
            t = asyncio.get_running_loop().create_task(self._download(layer, index))
            self._flights[digest] = t
            t.add_done_callback(lambda _t: self._flights.pop(digest, None))
        return await asyncio.shield(t)

    def _local_copies(self, digest: str) -> list[tuple[str, int]]:
        """(cache file, offset) of every present copy of a chunk in the cache."""
        return [(self.cache.data_path(other.digest), i * other.manifest.chunk_size)
                for other in self.layers.values()
                for i in self._holders(other).get(digest, ()) if self._present(other, i)]

    def _read_copy(self, digest: str, length: int,
                   copies: list[tuple[str, int]]) -> bytes | None:
        """The chunk's bytes from one of ``copies``, verified (one may have been evicted
        meanwhile)."""
        for path, off in copies:
            try:
                with open(path, "rb") as f:
                    data = os.pread(f.fileno(), length, off)
                return verify_chunk(digest, data, f"cache {self.cache.root}", length=length)
            except (OSError, CorruptError):
                continue
        return None

    def _holders(self, layer: Layer) -> dict[str, list[int]]:
        h = self._holder_maps.get(layer.digest)
        if h is None:
            h = {}
            for i, c in enumerate(layer.manifest.chunks):
                h.setdefault(c.digest, []).append(i)
            self._holder_maps[layer.digest] = h
        return h

    async def _download(self, layer: Layer, index: int) -> bytes:
        loop = asyncio.get_running_loop()
        ref = layer.manifest.chunks[index]
        length = layer.manifest.chunk_length(index)
        copies = self._local_copies(ref.digest)
        if copies:
            local = await asyncio.to_thread(self._read_copy, ref.digest, length, copies)
            if local is not None:
                return local
        remote = self._remote(layer.remote)
        deadline = loop.time() + self.fetch_timeout
        delay, attempts = 0.05, 0
        last: BaseException | None = None
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            attempts += 1
            try:
                async with self._sem:
                    t0 = time.monotonic()
                    # asyncio.timeout, not wait_for: no extra task per fetch.
                    async with asyncio.timeout(min(remaining, self.attempt_timeout)):
                        data = await remote.chunk(ref.digest, length=length)
                    spent = time.monotonic() - t0
                layer.observe(spent, len(data))
                return data
            except CorruptError as exc:
                layer.corrupt += 1
                log.warning("layer %s chunk %d: %s; discarded, fetching again",
                            layer.digest, index, exc)
                last = exc
            except (RemoteError, NotFoundError, TimeoutError, OSError) as exc:
                last = exc
            await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
            delay = min(delay * 2, 2.0)
        why = f"{type(last).__name__}: {last}" if last is not None else "no attempt"
        raise FetchFailed(errno.EIO, f"layer {layer.digest} chunk {index} ({ref.digest}) from "
                                     f"remote {layer.remote}: gave up after {attempts} "
                                     f"attempt(s) in {self.fetch_timeout:g} s; last error: "
                                     f"{why}")

    async def prefetch(self, digest: str, indexes: list[int] | None = None,
                       workers: int = 4) -> int:
        """Fetch chunks of layer ``digest`` in the background, after on-demand fetches
        (a prefetch fetch starts only when none is in flight). ``indexes`` default to the
        recorded access trace. Returns how many chunks were queued."""
        layer = self.layers.get(digest)
        if layer is None:
            raise NotFoundError(f"layer {digest} is not registered")
        todo = [i for i in (indexes if indexes is not None else self.cache.trace(digest))
                if 0 <= i < len(layer.manifest.chunks)]
        queue = list(reversed(todo))

        async def worker() -> None:
            while queue:
                await self._idle.wait()
                if not queue:  # another worker took the last one meanwhile
                    break
                i = queue.pop()
                if not self._live(layer):
                    break
                if lib.lfs_lazy_chunk_claim(self.lz, layer.slot, i) == 1:
                    await self._fetch(layer, i, ondemand=False)

        for _ in range(max(1, workers)):
            self._spawn(worker())
        return len(todo)

    def trace(self, digest: str, *, save: bool = False, reset: bool = False) -> list[int]:
        """Chunk indexes of layer ``digest`` in first-read order since the last reset;
        ``save`` records them as the layer's prefetch list."""
        layer = self.layers.get(digest)
        if layer is None:
            raise NotFoundError(f"layer {digest} is not registered")
        n = len(layer.manifest.chunks)
        buf = ffi.new("uint32_t[]", max(1, n))
        got = lib.lfs_lazy_trace(self.lz, layer.slot, buf, n, 1 if reset else 0)
        out = [int(buf[i]) for i in range(min(got, n))]
        if save:
            self.cache.save_trace(digest, out)
        return out

    def evict(self, target: int) -> int:
        """Evict cached chunks until the cache holds at most ``target`` bytes: first the
        files of unregistered layers, then the least recently read chunks that no read is
        using right now (their bits are cleared and persisted before their holes are
        punched). Returns the bytes freed."""
        freed = 0
        for digest in list(self._orphans):
            if self._cache_bytes <= target:
                break
            self._orphans.pop(digest)
            n = self.cache.drop_data(digest)
            self._cache_bytes -= n
            freed += n
        atime = ffi.new("uint64_t *")
        cands: list[tuple[int, int, Layer]] = []
        for layer in self.layers.values():
            for i in range(len(layer.manifest.chunks)):
                if lib.lfs_lazy_chunk_info(self.lz, layer.slot, i, atime) == \
                        lib.LFS_LAZY_PRESENT:
                    cands.append((int(atime[0]), i, layer))
        cands.sort(key=lambda c: (c[0], c[1]))
        evicted: list[tuple[Layer, int]] = []
        for _, i, layer in cands:
            if self._cache_bytes <= target:
                break
            if lib.lfs_lazy_chunk_evict(self.lz, layer.slot, i) == 1:
                n = layer.manifest.chunk_length(i)
                self._cache_bytes -= n
                freed += n
                evicted.append((layer, i))
        flushed = set()
        for layer in {layer.digest: layer for layer, _ in evicted}.values():
            # No await from the evict marks to the punches: a chunk marked missing here
            # can only be written again by a fetch this event loop starts later.
            try:
                self._flush_present(layer)
            except LayerfsError as exc:
                # Its bitmap on disk still names these chunks: keep their bytes.
                log.warning("cache: layer %s: %s; not punching its evicted chunks",
                            layer.digest, exc)
                continue
            flushed.add(layer.digest)
            self._dirty.discard(layer.digest)
        err = new_error()
        for layer, i in evicted:
            if layer.digest in flushed and \
                    lib.lfs_lazy_chunk_punch(self.lz, layer.slot, i, err) < 0:
                log.warning("cache: %s", ffi.string(err.msg).decode())
        if freed:
            log.info("cache: evicted %d bytes, %d bytes left", freed, self._cache_bytes)
        return freed

    # -- metrics ------------------------------------------------------------------------

    def layer_stats(self, layer: Layer) -> dict[str, Any]:
        st = ffi.new("struct lfs_lazy_stats *")
        lib.lfs_lazy_layer_stats(self.lz, layer.slot, st)
        m = layer.manifest
        return {
            "digest": layer.digest, "slot": layer.slot, "remote": layer.remote,
            "file": os.path.join(self.cache.path("fuse"), layer.name),
            "size": m.size, "chunks": len(m.chunks), "chunk_size": m.chunk_size,
            "present_chunks": int(st.present), "inflight": int(st.inflight),
            "bytes_fetched": layer.bytes_fetched, "chunks_fetched": layer.chunks_fetched,
            "fraction_fetched": layer.bytes_fetched / m.size if m.size else 0.0,
            "fraction_present": int(st.present) / len(m.chunks) if m.chunks else 0.0,
            "reads": int(st.reads), "read_bytes": int(st.read_bytes), "hits": int(st.hits),
            "misses": int(st.misses), "hit_ratio": int(st.hits) / int(st.reads)
            if st.reads else 0.0,
            "wait_seconds": int(st.wait_ns) / 1e9,
            "queued": int(st.fetches), "speculative": int(st.speculative),
            "failed": int(st.failed), "errors": int(st.errors),
            "corrupt": layer.corrupt, "touched_chunks": int(st.touched),
            "fetch_latency": {"buckets": list(LATENCY_BUCKETS),
                              "counts": list(layer.latency_counts),
                              "sum": layer.latency_sum, "count": sum(layer.latency_counts)},
        }

    def slots(self) -> dict[str, int]:
        """Layer slots (inode numbers) by state: ``live`` (registered), ``held`` (removed,
        the kernel still has the file's inode), ``reusable``, ``pinned`` (not registered
        and never reused by this server: its predecessor may have handed them out), and
        the ``max``."""
        out = ffi.new("struct lfs_lazy_slots *")
        lib.lfs_lazy_slot_counts(self.lz, out)
        return {"live": int(out.live), "held": int(out.held),
                "reusable": int(out.reusable), "pinned": int(out.pinned),
                "max": int(lib.LFS_LAZY_MAX_LAYERS)}

    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(), "resumed": self.resumed, "slots": self.slots(),
            "cache": {"root": self.cache.root, "bytes": self._cache_bytes,
                      "limit": self.cache.limit},
            "layers": {d: self.layer_stats(layer) for d, layer in self.layers.items()},
        }

    # -- control API --------------------------------------------------------------------

    def app(self) -> web.Application:
        routes = web.RouteTableDef()

        def fail(status: int, exc: BaseException) -> web.Response:
            return web.json_response({"error": {"code": type(exc).__name__,
                                                "message": str(exc)}}, status=status)

        async def body(request: web.Request) -> dict[str, Any]:
            try:
                obj = await request.json() if request.can_read_body else {}
            except ValueError as exc:
                raise web.HTTPBadRequest(text=f"body is not JSON: {exc}") from None
            return obj if isinstance(obj, dict) else {}

        @routes.get("/v1/health")
        async def health(request: web.Request) -> web.Response:
            return web.json_response({"ok": True, "pid": os.getpid()})

        @routes.get("/v1/stats")
        async def stats(request: web.Request) -> web.Response:
            return web.json_response(self.stats())

        @routes.post("/v1/layers")
        async def register(request: web.Request) -> web.Response:
            b = await body(request)
            try:
                layer = await self.register(str(b.get("digest")), str(b.get("remote")))
            except NotFoundError as exc:
                return fail(404, exc)
            except (RemoteError, OSError) as exc:
                return fail(502, exc)
            except (LayerfsError, ValueError) as exc:
                return fail(400, exc)
            return web.json_response(self.layer_stats(layer))

        @routes.delete("/v1/layers/{digest}")
        async def unregister(request: web.Request) -> web.Response:
            try:
                self.unregister(request.match_info["digest"])
            except NotFoundError as exc:
                return fail(404, exc)
            except (OSError, LayerfsError) as exc:
                return fail(507 if getattr(exc, "errno", None) == errno.ENOSPC else 500, exc)
            return web.json_response({"ok": True})

        @routes.post("/v1/prefetch")
        async def prefetch(request: web.Request) -> web.Response:
            b = await body(request)
            try:
                n = await self.prefetch(str(b.get("digest")), b.get("chunks"))
            except NotFoundError as exc:
                return fail(404, exc)
            return web.json_response({"queued": n})

        @routes.post("/v1/trace")
        async def trace(request: web.Request) -> web.Response:
            b = await body(request)
            try:
                out = self.trace(str(b.get("digest")), save=bool(b.get("save")),
                                 reset=bool(b.get("reset")))
            except NotFoundError as exc:
                return fail(404, exc)
            return web.json_response({"chunks": out})

        @routes.post("/v1/evict")
        async def evict(request: web.Request) -> web.Response:
            b = await body(request)
            return web.json_response({"freed": self.evict(int(b.get("target", 0)))})

        app = web.Application()
        app.add_routes(routes)
        return app

    async def run(self) -> None:
        """Serve until the FUSE connection goes away (unmount) or SIGTERM."""
        import signal

        self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        sock = self.cache.path("control.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)
        await web.UnixSite(runner, sock).start()
        try:
            await self._stop.wait()
        finally:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
                self._flush_dirty()
            await runner.cleanup()
            for r in self._remotes.values():
                await r.close()
            log.info("lazy server pid %d: stopping", os.getpid())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerfs.lazy.server")
    p.add_argument("--cache", required=True)
    p.add_argument("--fuse-fd", type=int, required=True)
    p.add_argument("--resumed", action="store_true")
    p.add_argument("--fetch-timeout", type=float, default=30.0)
    p.add_argument("--attempt-timeout", type=float, default=10.0)
    p.add_argument("--cache-limit", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--speculate", type=int, default=DEFAULT_SPECULATE)
    args = p.parse_args(argv)
    # One open cache file per registered layer: up to LFS_LAZY_MAX_LAYERS of them.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = lib.LFS_LAZY_MAX_LAYERS + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                hard))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s layerfs-lazy[%(process)d] %(levelname)s %(message)s")
    cache = ChunkCache(args.cache, limit=args.cache_limit, server=True)
    srv = LazyServer(cache, args.fuse_fd, resumed=args.resumed,
                     fetch_timeout=args.fetch_timeout, attempt_timeout=args.attempt_timeout,
                     concurrency=args.concurrency, speculate=args.speculate)
    asyncio.run(srv.run())
    # FUSE worker threads may sit in read(2) on the connection: leave without joining.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
