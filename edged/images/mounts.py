"""Node layer mounts: each layer mounted ONCE per node and shared by every sandbox using it.

A layer (``sha256:<hex>``) is mounted read-only (file-backed EROFS, Linux >= 6.12) at
``<mount_dir>/<hex>`` from an image file that :attr:`LayerOps.image` makes available. This is
the one owner of a mounted layer's lifetime on the node: its holders are counted here, the
last release keeps it ``linger_s`` seconds more (the next create finds it mounted and its
page cache warm, instead of paying a mount, an unmount and cold reads), then it is
unmounted. The operations below do no counting of their own.

On a real node (:meth:`LayerMounts.for_layerfs`) the image file is the layer's lazy file
(``layerfs.lazy``): the node's lazy FUSE server exposes it at once and fetches only the
chunks that are read, from the configured remote (``layers_remote``: a chunk server URL or a
shared directory). With no remote configured, the local layerfs store is that remote
(``file:<store_dir>``), so there is one code path either way. The lazy server is a node
service in its own session: sandboxes kept across a daemon restart keep reading through it.

The operations are injected (:class:`LayerOps`) so the lifetime is testable without root.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from edged.backends.base import LayerForm, UpperDir
from edged.errors import BackendError, BadRequest, EdgedError, NotFound
from edged.images.registry import check_digest

log = logging.getLogger("edged.images")


class LayerCounters(NamedTuple):
    """What the node's lazy server has done for one layer so far (monotonic counters)."""

    fetched: int  #: bytes fetched from the remote
    size: int  #: the layer's bytes
    reads: int = 0  #: reads of its file
    hits: int = 0  #: reads answered at once from the node cache
    wait_s: float = 0.0  #: seconds reads spent waiting for chunks, summed


@dataclass
class LayerOps:
    """Blocking operations behind :class:`LayerMounts` (run in a worker thread).

    ``image(digest) -> path``: make the layer's EROFS image file available and return its
    path (raise ``KeyError`` if no source holds the layer). ``mount(image_path,
    mountpoint)``, ``umount(mountpoint)``, ``is_mounted(mountpoint) -> bool``,
    ``has(digest) -> bool``. ``close()``: stop whatever serves the image files (called when
    the node shuts down with no sandbox left). ``collector``: a prometheus-client collector
    of the layer source's metrics, if it has any. ``fetched() -> {digest:
    LayerCounters}``: what the node has fetched and served so far of each layer it serves
    lazily. ``healthy() -> bool``: whether the service that serves the image files answers
    (raises OSError when the caller cannot tell, e.g. out of descriptors);
    ``recover() -> list[str] | None``: bring it back if it does not (raises if it cannot),
    returning None, or the digests whose mounts were lost with its connection (see
    :meth:`layerfs.manager.LayerManager.recover`). Both None: a source that cannot fail
    (the local tests' doubles). ``leave()``: the daemon goes away and leaves its layers
    mounted for the sandboxes it keeps: drop what this process holds of the source.
    ``add_upper(upper, kind, exclude) -> dict``: make a sandbox's upper directory
    (:class:`~edged.backends.base.UpperDir`) a layer in the store the node loads layers
    from (a snapshot; None where the node cannot add layers, e.g. a chunk server remote):
    its digest, size and what was left out (:class:`layerfs.sources.upper.UpperReport`).
    """

    image: Callable[[str], str]
    mount: Callable[[str, str], object]
    umount: Callable[[str], object]
    is_mounted: Callable[[str], bool]
    has: Callable[[str], bool]
    close: Callable[[], object] | None = None
    collector: Any = None
    fetched: Callable[[], dict[str, LayerCounters]] | None = None
    healthy: Callable[[], bool] | None = None
    recover: Callable[[], list[str] | None] | None = None
    leave: Callable[[], object] | None = None
    add_upper: Callable[[UpperDir, str, list[str]], dict[str, Any]] | None = None


class LayerMounts:
    """Refcounted node-wide layers, in the form a backend needs (:data:`LayerForm`): a
    ``"tree"`` is the layer mounted (``acquire`` → mountpoint; ``release`` → unmount when the
    count drops to zero; concurrent acquires of one digest mount it once), an ``"image"``
    the layer's image file made available (``acquire`` → its path; nothing to undo)."""

    def __init__(self, ops: LayerOps, mount_dir: Path, *, linger_s: float = 0.0) -> None:
        self.ops = ops
        self.mount_dir = mount_dir
        #: seconds a layer stays mounted after its last holder lets go (0: unmount at once)
        self.linger_s = linger_s
        self._refs: dict[str, int] = {}
        self._images: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: layer -> timer: the last holder's reference, kept ``linger_s`` longer
        self._linger: dict[str, asyncio.TimerHandle] = {}
        self._unlingering: set[asyncio.Task[None]] = set()

    @classmethod
    def for_layerfs(cls, store_dir: str, cache_dir: Path, mount_dir: Path, *,
                    remote: str = "", cache_limit: int | None = None,
                    fetch_timeout: float = 30.0) -> LayerMounts:
        """Layers loaded lazily from ``remote`` (default: the local store ``store_dir``,
        created if absent, as a ``file:`` remote) through the node's lazy server on the
        cache directory ``cache_dir`` (started if not running; ``cache_limit`` bytes,
        ``fetch_timeout`` seconds before a read of an unreachable chunk fails with EIO).
        layerfs is imported here, not at module load, so the SDK-free parts of edged stay
        importable without the C core. Raises :class:`BackendError` if the lazy server
        does not start."""
        from layerfs import mount as lmount
        from layerfs.errors import LayerfsError
        from layerfs.lazy.metrics import LazyCollector
        from layerfs.manager import LayerManager

        has: Callable[[str], bool]
        writable: str | None = None  # the store new layers go to (snapshots)
        if not remote:
            from layerfs.store import Store

            st = Store(store_dir or None)
            remote = "file:" + st.root
            has = st.has_layer
            writable = st.root
        else:
            has = functools.partial(_remote_has, remote)
            if remote.startswith("file:"):
                writable = remote[5:]
        try:
            mgr = LayerManager(str(cache_dir), remote, str(mount_dir), idle_seconds=0.0,
                               fetch_timeout=fetch_timeout, cache_limit=cache_limit)
        except LayerfsError as e:
            raise BackendError(f"layer cache {cache_dir}: {e}") from e

        def image(digest: str) -> str:
            return str(mgr.client.register(digest, remote)["file"])

        def mount(img: str, mp: str) -> None:
            digest = "sha256:" + os.path.basename(mp)
            got = mgr.mount(digest)  # uncounted: the holders are counted here
            if os.path.abspath(got) != os.path.abspath(mp):
                mgr.unmount(digest)
                raise BackendError(f"layer {digest}: mounted at {got}, not {mp}")

        def umount(mp: str) -> None:
            if not mgr.unmount("sha256:" + os.path.basename(mp)) and os.path.ismount(mp):
                lmount.umount(mp)  # mounted by an earlier daemon, re-adopted

        def close() -> None:
            mgr.close()
            from layerfs.lazy import client

            client.stop(str(cache_dir))  # also a server an earlier daemon started

        def fetched() -> dict[str, LayerCounters]:
            return {d: LayerCounters(int(st["bytes_fetched"]), int(st["size"]),
                                     int(st["reads"]), int(st["hits"]),
                                     float(st["wait_seconds"]))
                    for d, st in mgr.client.stats()["layers"].items()}

        def add_upper(upper: UpperDir, kind: str, exclude: list[str]) -> dict[str, Any]:
            return _add_upper(writable, upper, kind, exclude)

        ops = LayerOps(image=image, mount=mount, umount=umount, is_mounted=os.path.ismount,
                       has=has, close=close, collector=LazyCollector(mgr.client),
                       fetched=fetched, healthy=mgr.healthy, recover=mgr.recover,
                       leave=mgr.leave, add_upper=add_upper if writable else None)
        return cls(ops, mount_dir)

    def mountpoint(self, digest: str) -> Path:
        """Where ``digest`` is (or would be) mounted."""
        return self.mount_dir / check_digest(digest).split(":", 1)[1]

    def refs(self) -> dict[str, int]:
        """Digest → number of holders, for ``GET /v1/node``."""
        return dict(self._refs)

    async def acquire(self, digest: str, form: LayerForm = "tree") -> str:
        """Mount ``digest`` if not yet mounted (``"image"``: make its image file available),
        count one more holder, return the mountpoint (the image file's path). Raises
        :class:`NotFound` if the store lacks the layer, :class:`BackendError` if the export
        or mount fails (nothing is left mounted or counted then)."""
        if form == "image":
            path = await asyncio.to_thread(self._image, check_digest(digest))
            self._images[digest] = self._images.get(digest, 0) + 1
            return path
        mp = self.mountpoint(digest)
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:
            n = self._refs.get(digest, 0)
            if n == 0:
                await asyncio.to_thread(self._mount, digest, mp)
            self._refs[digest] = n + 1
        return str(mp)

    async def acquire_all(self, digests: list[str], form: LayerForm = "tree") -> list[str]:
        """:meth:`acquire` each digest in order; on failure release the ones taken."""
        taken: list[str] = []
        paths: list[str] = []
        try:
            for d in digests:
                paths.append(await self.acquire(d, form))
                taken.append(d)
        except BaseException:
            for d in reversed(taken):
                with contextlib.suppress(EdgedError):
                    await self.release(d, form)
            raise
        return paths

    def _image(self, digest: str) -> str:
        try:
            if not self.ops.has(digest):
                raise NotFound(f"layer {digest}: not in the layer store")
            return self.ops.image(digest)
        except EdgedError:
            raise
        except KeyError as e:
            raise NotFound(f"layer {digest}: not in the layer store") from e
        except Exception as e:
            raise BackendError(f"layer {digest}: no image file: {e}") from e

    def _mount(self, digest: str, mp: Path) -> None:
        if self.ops.is_mounted(str(mp)):
            return  # left by a previous daemon whose sandboxes we are re-adopting
        try:
            if not self.ops.has(digest):
                raise NotFound(f"layer {digest}: not in the layer store")
            img = self.ops.image(digest)
            mp.mkdir(parents=True, exist_ok=True)
            self.ops.mount(img, str(mp))
        except EdgedError:
            raise
        except KeyError as e:
            raise NotFound(f"layer {digest}: not in the layer store") from e
        except Exception as e:
            with contextlib.suppress(OSError):
                mp.rmdir()
            raise BackendError(f"layer {digest}: cannot mount at {mp}: {e}") from e

    async def remount(self, digests: list[str]) -> list[str]:
        """Mount again, at the same mountpoint, each of ``digests`` that holders count but
        whose mount was lost (detached with a dead connection of the layer source), so
        that the next sandbox gets a live one; returns those remounted. Failures are
        logged: the next acquire tries again."""
        done = []
        for d in digests:
            lock = self._locks.setdefault(d, asyncio.Lock())
            async with lock:
                if not self._refs.get(d):
                    continue
                try:
                    await asyncio.to_thread(self._mount, d, self.mountpoint(d))
                except EdgedError as e:
                    log.warning("layer %s: cannot mount it again: %s", d, e)
                    self._refs.pop(d, None)  # the next acquire mounts it
                    continue
                done.append(d)
        return done

    async def fetched(self, digests: list[str]) -> dict[str, LayerCounters] | None:
        """``{digest: LayerCounters}`` (what the node has fetched and served so far) for those of
        ``digests`` that the layer source serves now (a layer not yet registered is
        absent: nothing fetched), or None if it does not load lazily or does not answer."""
        if self.ops.fetched is None:
            return None
        try:
            per = await asyncio.to_thread(self.ops.fetched)
        except Exception:
            return None
        return {d: per[d] for d in digests if d in per}

    async def release(self, digest: str, form: LayerForm = "tree") -> None:
        """Count one holder less. The last holder's reference is kept ``linger_s`` seconds
        more (a release meanwhile restarts the wait), then dropped, which unmounts the
        layer. Raises :class:`BackendError` if an unmount fails (the count is still dropped;
        :meth:`close` retries)."""
        if form == "image":
            n = self._images.pop(digest, 0) - 1
            if n > 0:
                self._images[digest] = n
            return
        if self.linger_s > 0:
            held = self._linger.pop(digest, None)
            if held is not None:
                held.cancel()
            self._linger[digest] = asyncio.get_running_loop().call_later(
                self.linger_s, self._unlinger, digest)
            if held is None:
                return  # this holder's reference becomes the lingering one
        await self._drop(digest)

    def lingering(self) -> list[str]:
        """Layers held only because they were used recently (``linger_s``)."""
        return sorted(self._linger)

    def _unlinger(self, digest: str) -> None:
        if self._linger.pop(digest, None) is not None:
            task = asyncio.ensure_future(self._drop_logged(digest))
            self._unlingering.add(task)
            task.add_done_callback(self._unlingering.discard)

    async def _drop_logged(self, digest: str) -> None:
        try:
            await self._drop(digest)
        except EdgedError as e:
            log.warning("layer release failed: %s", e)

    async def flush(self) -> None:
        """Drop every lingering reference now (unmounting those layers) and wait for the
        drops already under way. Errors are logged."""
        for d in list(self._linger):
            self._linger.pop(d).cancel()
            await self._drop_logged(d)
        while self._unlingering:
            await asyncio.gather(*list(self._unlingering), return_exceptions=True)

    async def _drop(self, digest: str) -> None:
        """One reference less; unmount at zero."""
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:
            n = self._refs.get(digest, 0)
            if n <= 1:
                self._refs.pop(digest, None)
                if n == 1:
                    await asyncio.to_thread(self._umount, self.mountpoint(digest))
            else:
                self._refs[digest] = n - 1

    def _umount(self, mp: Path) -> None:
        try:
            if self.ops.is_mounted(str(mp)):
                self.ops.umount(str(mp))
            with contextlib.suppress(OSError):
                mp.rmdir()
        except Exception as e:
            raise BackendError(f"cannot unmount layer at {mp}: {e}") from e

    async def sweep(self) -> list[str]:
        """Unmount and remove every mountpoint under ``mount_dir`` that no holder counts:
        what a crashed daemon left behind (call after re-adopting sandboxes). Returns the
        mountpoints removed."""
        if not self.mount_dir.is_dir():
            return []
        held = {str(self.mountpoint(d)) for d in self._refs}
        gone = []
        for p in sorted(self.mount_dir.iterdir()):
            if str(p) in held or p.name.startswith("."):  # the source's own files
                continue
            try:
                await asyncio.to_thread(self._umount, p)
                gone.append(str(p))
            except BackendError:
                continue
        return gone

    async def leave(self) -> None:
        """The daemon goes away, its sandboxes and their layer mounts kept (``ops.leave``)."""
        if self.ops.leave is not None:
            await asyncio.to_thread(self.ops.leave)

    async def close(self) -> None:
        """Unmount every layer still mounted and stop the layer source (daemon shutdown
        with no sandboxes kept)."""
        await self.flush()
        for d in list(self._refs):
            self._refs[d] = 1
            with contextlib.suppress(EdgedError):
                await self._drop(d)
        if self.ops.close is not None:
            try:
                await asyncio.to_thread(self.ops.close)
            except Exception as e:
                raise BackendError(f"stopping the layer source: {e}") from e


def _add_upper(store_dir: str | None, upper: UpperDir, kind: str,
               exclude: list[str]) -> dict[str, Any]:
    """:attr:`LayerOps.add_upper` for a layerfs store at ``store_dir``. Raises BadRequest
    (a hostile or unrepresentable upper entry, a bad exclude: named), BackendError."""
    from dataclasses import asdict

    from layerfs.build import build_tree
    from layerfs.errors import InvalidSourceError, LayerfsError
    from layerfs.sources.upper import load_upper
    from layerfs.store import Store

    try:
        tree, rep = load_upper(upper.path, id_base=upper.id_base, id_count=upper.id_count,
                               exclude=exclude)
        res = build_tree(tree, kind=kind, store=Store(store_dir), source="snapshot")
    except (InvalidSourceError, ValueError, LayerfsError, OSError) as e:
        # the sandbox's own path, not the host's, and not a whole 4 KiB of it
        msg = str(e).replace(upper.path, "")
        msg = msg if len(msg) <= 300 else msg[:150] + "..." + msg[-100:]
        if isinstance(e, InvalidSourceError | ValueError) or getattr(e, "errno", None) in (
                errno.ENAMETOOLONG, errno.ELOOP, errno.EOVERFLOW):
            raise BadRequest(f"snapshot: the sandbox's changes cannot be a layer: {msg}") from e
        raise BackendError(f"snapshot: {msg}") from e
    return {"digest": res.digest, "size": res.size, "kind": kind, **asdict(rep)}


def _remote_has(url: str, digest: str) -> bool:
    """Whether the remote at ``url`` holds layer ``digest`` (blocking; its own event loop
    in a worker thread, since the caller may be on the daemon's loop)."""
    from concurrent.futures import ThreadPoolExecutor

    from layerfs.errors import LayerfsError
    from layerfs.remote.connect import open_remote

    async def ask() -> bool:
        async with open_remote(url) as r:
            return await r.has_layer(digest)

    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(asyncio.run, ask()).result(60)
        except (LayerfsError, OSError) as e:
            raise BackendError(f"layer {digest}: asking remote {url}: {e}") from e
