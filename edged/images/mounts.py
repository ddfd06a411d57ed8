"""Node layer mounts: each layer mounted ONCE per node and shared by every sandbox using it.

A layer (``sha256:<hex>``) is exported from the layerfs store to a cache file
``<cache_dir>/<hex>.erofs`` and mounted read-only (file-backed EROFS mount, Linux ≥ 6.12) at
``<mount_dir>/<hex>``. Mounts are refcounted; the last release unmounts. The cache file stays
(re-mounting is then cheap); it is the store's copy, checked by its digest on export.

The store and mount operations are injected (``export``, ``mount``, ``umount``,
``is_mounted``) so the refcounting is testable without root; :meth:`LayerMounts.for_layerfs`
wires the real ones from :mod:`layerfs.store` and :mod:`layerfs.mount`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edged.errors import BackendError, EdgedError, NotFound
from edged.images.registry import check_digest


@dataclass
class LayerOps:
    """Blocking operations behind :class:`LayerMounts` (run in a worker thread).

    ``export(digest, out_path)``: write the layer's bytes to ``out_path`` (raise ``KeyError``
    if the store lacks it). ``mount(image_path, mountpoint)``, ``umount(mountpoint)``,
    ``is_mounted(mountpoint) -> bool``. ``has(digest) -> bool``.
    """

    export: Callable[[str, str], object]
    mount: Callable[[str, str], object]
    umount: Callable[[str], object]
    is_mounted: Callable[[str], bool]
    has: Callable[[str], bool]


class LayerMounts:
    """Refcounted node-wide layer mounts. ``acquire`` → mountpoint path; ``release`` → unmount
    when the count drops to zero. Concurrent acquires of one digest mount it once."""

    def __init__(self, ops: LayerOps, cache_dir: Path, mount_dir: Path) -> None:
        self.ops = ops
        self.cache_dir = cache_dir
        self.mount_dir = mount_dir
        self._refs: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def for_layerfs(cls, store_dir: str, cache_dir: Path, mount_dir: Path) -> LayerMounts:
        """Wire the real layerfs store (:class:`layerfs.store.Store`, created if absent) and
        file-backed EROFS mounts (:mod:`layerfs.mount`); imported here, not at module load,
        so the SDK-free parts of edged stay importable without the C core."""
        from layerfs import mount as lmount
        from layerfs.store import Store

        st = Store(store_dir or None)

        def has(d: str) -> bool:
            try:
                st.manifest(d)
            except KeyError:
                return False
            return True

        ops = LayerOps(
            export=lambda d, out: st.export(d, out),
            mount=lambda img, mp: lmount.mount_erofs(img, mp),
            umount=lambda mp: lmount.umount(mp),
            is_mounted=os.path.ismount,
            has=has,
        )
        return cls(ops, cache_dir, mount_dir)

    def mountpoint(self, digest: str) -> Path:
        """Where ``digest`` is (or would be) mounted."""
        return self.mount_dir / check_digest(digest).split(":", 1)[1]

    def refs(self) -> dict[str, int]:
        """Digest → number of holders, for ``GET /v1/node``."""
        return dict(self._refs)

    async def acquire(self, digest: str) -> str:
        """Mount ``digest`` if not yet mounted, count one more holder, return the mountpoint.
        Raises :class:`NotFound` if the store lacks the layer, :class:`BackendError` if the
        export or mount fails (nothing is left mounted or counted then)."""
        mp = self.mountpoint(digest)
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:
            n = self._refs.get(digest, 0)
            if n == 0:
                await asyncio.to_thread(self._mount, digest, mp)
            self._refs[digest] = n + 1
        return str(mp)

    async def acquire_all(self, digests: list[str]) -> list[str]:
        """:meth:`acquire` each digest in order; on failure release the ones taken."""
        taken: list[str] = []
        try:
            for d in digests:
                await self.acquire(d)
                taken.append(d)
        except BaseException:
            for d in reversed(taken):
                with contextlib.suppress(EdgedError):
                    await self.release(d)
            raise
        return [str(self.mountpoint(d)) for d in digests]

    def _mount(self, digest: str, mp: Path) -> None:
        if self.ops.is_mounted(str(mp)):
            return  # left by a previous daemon whose sandboxes we are re-adopting
        img = self.cache_dir / (digest.split(":", 1)[1] + ".erofs")
        try:
            if not img.exists():
                if not self.ops.has(digest):
                    raise NotFound(f"layer {digest}: not in the layer store")
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                tmp = img.with_name("." + img.name + f".{os.getpid()}.tmp")
                try:
                    self.ops.export(digest, str(tmp))
                    os.replace(tmp, img)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        tmp.unlink()
            mp.mkdir(parents=True, exist_ok=True)
            self.ops.mount(str(img), str(mp))
        except EdgedError:
            raise
        except KeyError as e:
            raise NotFound(f"layer {digest}: not in the layer store") from e
        except Exception as e:
            raise BackendError(f"layer {digest}: cannot mount at {mp}: {e}") from e

    async def release(self, digest: str) -> None:
        """Count one holder less; unmount at zero. Raises :class:`BackendError` if the
        unmount fails (the count is still dropped; :meth:`close` retries)."""
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
            if str(p) in held:
                continue
            try:
                await asyncio.to_thread(self._umount, p)
                gone.append(str(p))
            except BackendError:
                continue
        return gone

    async def close(self) -> None:
        """Unmount every layer still mounted (daemon shutdown with no sandboxes kept)."""
        for d in list(self._refs):
            self._refs[d] = 1
            with contextlib.suppress(EdgedError):
                await self.release(d)
