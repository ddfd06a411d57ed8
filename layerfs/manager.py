"""The node layer manager: lazily loaded layers mounted once per node, shared by every
sandbox, and per-sandbox overlay root filesystems on top.

Each layer (``sha256:<hex>``) is registered with the node's lazy server (which exposes it
as ``CACHE/fuse/<hex>.erofs``, fetched chunk by chunk) and mounted read-only, file-backed
EROFS, at ``MOUNT_ROOT/<hex>``. :meth:`LayerManager.acquire` counts users;
:meth:`LayerManager.release` drops the count, and a layer nobody has used for
``idle_seconds`` is unmounted by :meth:`LayerManager.reap` (so a sandbox that restarts at
once finds its layers still mounted and its pages still cached). A caller that owns the
layers' lifetime itself (edged's node layer mounts: refcount, linger, unmount) uses the
uncounted :meth:`LayerManager.mount` and :meth:`LayerManager.unmount` instead, so that
nothing is counted twice. The lazy server keeps the
last ``keep_registered`` unmounted layers registered (remounting one costs no manifest
fetch) and the manager unregisters older ones, so a node that runs many distinct layers
over its life (a workspace per task) never runs out of the server's layer slots.

Access traces: when a layer's last user releases it, the chunks read since it was
mounted are recorded as its prefetch list; the next :meth:`acquire` that mounts it replays
that list in the background, below on-demand reads in priority.

A sandbox root (:meth:`LayerManager.compose`) is overlayfs with the layers as lowerdirs
(top first: toolkit, workspace, base) and upper/work on a per-sandbox tmpfs whose size is
the sandbox's disk limit (a write past it fails with ENOSPC inside the sandbox, never on the
node's disk).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import re
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from layerfs.errors import LayerfsError
from layerfs.lazy import client
from layerfs.manifest import check_digest
from layerfs.mount import mount_erofs, mount_overlay, mount_tmpfs, umount

#: Seconds a layer's access trace (saved as its last user lets it go) may wait for the
#: lazy server: the trace only speeds up the next start's prefetch.
TRACE_TIMEOUT_S = 5.0


@dataclass
class _Mounted:
    digest: str
    mountpoint: str
    refs: int = 0
    idle_since: float = 0.0


@dataclass(frozen=True, slots=True)
class Rootfs:
    """A composed sandbox root: ``path`` is the overlay mountpoint; ``layers`` the layer
    digests it holds (bottom first); ``scratch`` the tmpfs holding upper and work."""

    sandbox: str
    path: str
    layers: tuple[str, ...]
    scratch: str


class LayerManager:
    """Layers of one node (see the module docstring).

    ``cache``: the lazy cache directory (its server is started if not running and
    stopped by :meth:`close` if this manager started it); ``remote``: the default remote
    URL; ``mount_root``: where layers are mounted; ``idle_seconds``: how long an unused
    layer stays mounted; ``keep_registered``: how many unmounted layers stay registered
    with the lazy server (least recently unmounted ones are unregistered first).
    Methods are thread-safe and blocking. Errors: ``NotFoundError``
    when a remote lacks a layer, ``RemoteError``, ``NativeError`` from mount(2).
    """

    def __init__(self, cache: str, remote: str, mount_root: str, *,
                 idle_seconds: float = 60.0, fetch_timeout: float = 30.0,
                 cache_limit: int | None = None, prefetch: bool = True,
                 keep_registered: int = 256) -> None:
        self.remote = remote
        self.mount_root = os.path.abspath(mount_root)
        self.idle_seconds = idle_seconds
        self.prefetch = prefetch
        self.keep_registered = max(0, keep_registered)
        os.makedirs(self.mount_root, exist_ok=True)
        self._fetch_timeout, self._cache_limit = fetch_timeout, cache_limit
        self._proc = client.start(cache, fetch_timeout=fetch_timeout, cache_limit=cache_limit)
        self.client = client.LazyClient(cache)
        self._probe = client.LazyClient(cache, timeout=5.0)  # health: a wedged one is down
        # What is only worth a short wait: the access traces saved as layers are let go
        # (best effort: a stopped or wedged server had held every delete 60 s here, with
        # the lock that the restart which would end the wedge needs)
        self._aside = client.LazyClient(cache, timeout=TRACE_TIMEOUT_S)
        self._lock = threading.Lock()
        self._layers: dict[str, _Mounted] = {}
        self._roots: dict[str, Rootfs] = {}
        # A copy of the fd on the server's FUSE connection: while we hold it, the
        # connection survives the supervisor and the server both (reads wait for the next
        # server instead of failing for good), see layerfs.lazy.supervisor.
        self._fuse_fd = client.take_fd(cache)
        # Layer mounts over a connection that has died since (found at start): their
        # digests, told by the next recover().
        self._lost: list[str] | None = self._check_connection()
        # Layers the lazy server has and nothing mounts (that this manager knows of),
        # oldest first: those it unmounted, and at start those an earlier manager left.
        self._unmounted: collections.OrderedDict[str, None] = collections.OrderedDict()
        with contextlib.suppress(LayerfsError, OSError):
            mounted = self._files_mounted()
            for d in sorted(self.client.stats()["layers"]):
                if d[7:] + ".erofs" not in mounted:
                    self._unmounted[d] = None

    # -- the lazy server ----------------------------------------------------------------

    def healthy(self) -> bool:
        """Whether the lazy server answers (within 5 s) under a supervisor (one that lost
        its supervisor is healthy only while nothing can replace it: we hold no fd on its
        connection). Raises OSError when this process cannot tell (out of descriptors or
        memory: EMFILE, ENFILE, ENOMEM), which says nothing of the server."""
        try:
            self._probe.health()
        except client.LazyServerError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise
            return False
        return self._fuse_fd is None or client.supervised(self.client.cache)

    def recover(self) -> list[str] | None:
        """Bring the lazy server back if it is not :meth:`healthy` (blocking, up to ~10 s,
        half of :data:`~layerfs.lazy.client.START_WAIT_S`;
        a server left without supervisor is replaced): a new
        supervisor on the same FUSE connection when this manager still holds it (the
        layer mounts and every reader of them carry on), else a new connection, with the
        layer mounts made over the dead one detached (the sandboxes using them keep
        reading what the page cache has; the rest fails with EIO: nothing brings an
        aborted FUSE connection back). Returns None when no connection was lost, else the
        digests whose mounts were detached (acquire mounts them again, over the new
        connection); also reports, once, mounts found dead when this manager started.
        Raises :class:`~layerfs.lazy.client.LazyServerError` if the server does not come
        back."""
        with self._lock:
            if not self.healthy():
                self._restart(wait=client.START_WAIT_S / 2)  # 10 s by default
            lost, self._lost = self._lost, None
            return lost

    def leave(self) -> None:
        """Let go of the FUSE connection (this process is ending; its layer mounts stay for
        whoever uses them): from now on the supervisor alone holds it."""
        with self._lock:
            if self._fuse_fd is not None:
                os.close(self._fuse_fd)
                self._fuse_fd = None

    def _restart(self, wait: float | None = None) -> None:
        """Start the lazy server again (on our connection if we hold it); then, if the
        connection changed, the layer mounts over the old one are lost (self._lost)."""
        if self._proc is not None:
            self._proc.poll()  # reap ours if it has ended (client.start waits for it
            # if it is still stopping or restarting its server)
        proc = client.start(self.client.cache, fetch_timeout=self._fetch_timeout,
                            cache_limit=self._cache_limit, fuse_fd=self._fuse_fd, wait=wait)
        if proc is not None:  # ours now (whoever started the one that stopped)
            self._proc = proc
        lost = self._check_connection()
        if lost is not None:
            self._lost = sorted(set(self._lost or ()) | set(lost))

    def _connection(self) -> int | None:
        """The device of the lazy server's FUSE mount (one per connection), or None."""
        try:
            return os.stat(os.path.join(self.client.cache, "fuse")).st_dev
        except OSError:
            return None

    def _check_connection(self) -> list[str] | None:
        """Compare the FUSE connection now with the one our layer mounts were made over
        (``mount_root/.connection``, so that it holds across restarts of the daemon): if it
        changed, detach every layer mount under ``mount_root`` (dead: their reads fail for
        good) and return their digests; None if it did not change."""
        cur = self._connection()
        marker = os.path.join(self.mount_root, ".connection")
        try:
            with open(marker) as f:
                was: int | None = int(f.read())
        except (OSError, ValueError):
            was = None
        lost: list[str] | None = None
        if was is not None and cur != was:
            lost = []
            for mp in self._erofs_mounts():
                with contextlib.suppress(OSError):
                    umount(mp, lazy=True)
                lost.append("sha256:" + os.path.basename(mp))
            for d in lost:
                self._layers.pop(d, None)
            for d in list(self._layers):  # mounted by us, not found there: dead too
                lost.append(d)
                del self._layers[d]
            if self._fuse_fd is not None:  # on the dead connection
                os.close(self._fuse_fd)
            self._fuse_fd = client.take_fd(self.client.cache)
        if cur is not None and cur != was:
            tmp = marker + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{cur}\n")
            os.replace(tmp, marker)
        return lost

    def _erofs_mounts(self) -> list[str]:
        """EROFS mountpoints directly under ``mount_root`` (ours, or an earlier manager's)."""
        out = []
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                fields = pre.split()
                if len(fields) < 5 or not post.startswith("erofs "):
                    continue
                mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                if os.path.dirname(mp) == self.mount_root:
                    out.append(mp)
        return out

    # -- layers -------------------------------------------------------------------------

    def acquire(self, digests: Sequence[str], remote: str | None = None) -> list[str]:
        """Mount each layer if it is not mounted yet and take one reference on each;
        returns their mountpoints in the same order. On failure no reference is taken."""
        for d in digests:
            check_digest(d)
        taken: list[str] = []
        try:
            with self._lock:
                for d in digests:
                    m = self._layers.get(d)
                    if m is None:
                        m = self._mount(d, remote or self.remote)
                    m.refs += 1
                    taken.append(d)
                return [self._layers[d].mountpoint for d in digests]
        except BaseException:
            self.release(taken)
            raise

    def _mount(self, digest: str, remote: str) -> _Mounted:
        try:
            info = self.client.register(digest, remote)
        except client.LazyServerError:
            if self.client.alive():
                raise
            # Stopped under us (an operator's `layerfs umount` of the last mount of a
            # shared cache, a crash): start it again; it restores every registration.
            self._restart()
            info = self.client.register(digest, remote)
        self._unmounted.pop(digest, None)
        mp = os.path.join(self.mount_root, digest[7:])
        os.makedirs(mp, exist_ok=True)
        mount_erofs(info["file"], mp)
        if self.prefetch:
            with contextlib.suppress(LayerfsError):
                self.client.prefetch(digest)
        m = self._layers[digest] = _Mounted(digest, mp)
        return m

    def mount(self, digest: str, remote: str | None = None) -> str:
        """Mount one layer (registered, its prefetch started) for a caller that counts its
        users itself; returns the mountpoint. One mounted already is left as it is."""
        check_digest(digest)
        with self._lock:
            m = self._layers.get(digest)
            if m is None:
                m = self._mount(digest, remote or self.remote)
            return m.mountpoint

    def unmount(self, digest: str) -> bool:
        """Record the layer's access trace and unmount it now (that caller's last user is
        gone). False if this manager has not mounted it, or counts users of it. Raises
        OSError if the kernel has it busy (it stays mounted)."""
        with self._lock:
            m = self._layers.get(digest)
            if m is None or m.refs:
                return False
            with contextlib.suppress(LayerfsError):
                self._aside.trace(digest, save=True)
            self._unmount(m)
            if len(self._unmounted) > self.keep_registered:
                self._trim()
        return True

    def _unmount(self, m: _Mounted) -> None:
        """Unmount ``m`` (lock held); it joins the registered-but-unmounted layers."""
        umount(m.mountpoint)
        with contextlib.suppress(OSError):
            os.rmdir(m.mountpoint)
        del self._layers[m.digest]
        self._unmounted[m.digest] = None

    def release(self, digests: Sequence[str]) -> None:
        """Drop one reference on each layer; the last one records its access trace."""
        with self._lock:
            for d in digests:
                m = self._layers.get(d)
                if m is None or m.refs == 0:
                    continue
                m.refs -= 1
                if m.refs == 0:
                    m.idle_since = time.monotonic()
                    with contextlib.suppress(LayerfsError):
                        self._aside.trace(d, save=True)

    def reap(self, idle_seconds: float | None = None) -> list[str]:
        """Unmount layers unused for ``idle_seconds`` (default: the manager's); returns
        their digests. A layer still busy in the kernel stays for the next call."""
        limit = self.idle_seconds if idle_seconds is None else idle_seconds
        now = time.monotonic()
        gone = []
        with self._lock:
            for d, m in list(self._layers.items()):
                if m.refs or now - m.idle_since < limit:
                    continue
                try:
                    self._unmount(m)
                except OSError:
                    continue
                gone.append(d)
            if len(self._unmounted) > self.keep_registered:
                self._trim()
        return gone

    def _files_mounted(self) -> set[str]:
        """Names of the lazy server's layer files that EROFS mounts on this node use as
        their source (ours, an earlier daemon's, an operator's ``layerfs mount``)."""
        fuse = os.path.realpath(os.path.join(self.client.cache, "fuse"))
        names = set()
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.partition(" - ")[2].split()
                if len(fields) < 2 or fields[0] != "erofs":
                    continue
                # octal escapes (proc_pid_mountinfo(5)); the source may name the cache
                # through a symlink
                src = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
                if os.path.realpath(os.path.dirname(src)) == fuse:
                    names.add(os.path.basename(src))
        return names

    def _trim(self) -> None:
        """Unregister the oldest unmounted layers beyond ``keep_registered``; one that
        something mounts after all is left registered (and forgotten here)."""
        try:
            mounted = self._files_mounted()
        except OSError:
            return
        while len(self._unmounted) > self.keep_registered:
            old, _ = self._unmounted.popitem(last=False)
            if old[7:] + ".erofs" in mounted:
                continue
            # Its file leaves the lazy server, which reuses the slot; its cached chunks
            # stay (first to go under pressure) for a later registration.
            with contextlib.suppress(LayerfsError):
                self.client.unregister(old)

    def mounted(self) -> dict[str, int]:
        """Mounted layers and their reference counts."""
        with self._lock:
            return {d: m.refs for d, m in self._layers.items()}

    # -- sandbox roots ------------------------------------------------------------------

    def compose(self, sandbox: str, layers: Sequence[str], scratch_root: str, *,
                disk_limit: int, remote: str | None = None) -> Rootfs:
        """Overlay root for ``sandbox``: ``layers`` bottom first (base, workspace,
        toolkit), upper and work on a ``disk_limit``-byte tmpfs under ``scratch_root``.
        Returns a :class:`Rootfs`; undo with :meth:`decompose`."""
        if not sandbox or "/" in sandbox or sandbox in (".", ".."):
            raise ValueError(f"sandbox id {sandbox!r} is not a file name")
        if disk_limit <= 0:
            raise ValueError(f"disk limit {disk_limit} must be positive bytes")
        mps = self.acquire(layers, remote)
        base = os.path.join(os.path.abspath(scratch_root), sandbox)
        scratch, root = os.path.join(base, "scratch"), os.path.join(base, "root")
        mounted_tmpfs = False
        try:
            os.makedirs(scratch)
            os.makedirs(root)
            mount_tmpfs(scratch, size=disk_limit)
            mounted_tmpfs = True
            os.mkdir(os.path.join(scratch, "upper"))
            os.mkdir(os.path.join(scratch, "work"))
            mount_overlay(list(reversed(mps)), os.path.join(scratch, "upper"),
                          os.path.join(scratch, "work"), root)
        except BaseException:
            if mounted_tmpfs:
                umount(scratch, lazy=True)
            shutil.rmtree(base, ignore_errors=True)
            self.release(layers)
            raise
        r = Rootfs(sandbox, root, tuple(layers), scratch)
        with self._lock:
            self._roots[sandbox] = r
        return r

    def decompose(self, rootfs: Rootfs) -> None:
        """Unmount a sandbox root and its scratch tmpfs, release its layers."""
        for mp in (rootfs.path, rootfs.scratch):
            try:
                umount(mp)
            except OSError:
                umount(mp, lazy=True)
        shutil.rmtree(os.path.dirname(rootfs.path), ignore_errors=True)
        with self._lock:
            self._roots.pop(rootfs.sandbox, None)
        self.release(rootfs.layers)

    def close(self) -> None:
        """Unmount every sandbox root and layer; stop the lazy server if we started it."""
        for r in list(self._roots.values()):
            self.decompose(r)
        with self._lock:
            for m in self._layers.values():
                m.refs = 0
                m.idle_since = 0.0
        self.reap(0)
        with self._lock:
            for m in self._layers.values():  # still busy: detach
                with contextlib.suppress(OSError):
                    umount(m.mountpoint, lazy=True)
            self._layers.clear()
        if self._proc is not None:
            client.stop(self.client.cache, proc=self._proc)
            self._proc = None
        if self._fuse_fd is not None:  # the last holder, once the supervisor is gone
            os.close(self._fuse_fd)
            self._fuse_fd = None
