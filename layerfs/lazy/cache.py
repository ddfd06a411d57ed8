"""The node's lazy-loading cache directory: chunks fetched from remotes, kept uncompressed
so that a cached read is a plain ``pread`` in the C file server.

Layout (version 1)::

    ROOT/layout               "layerfs-lazy-cache 1\\n"
    ROOT/chunks/XX/<hex>      the exact (uncompressed, verified) bytes of chunk sha256:<hex>
    ROOT/layers/<hex>.json    registered layers: {"slot", "remote", "manifest"}
    ROOT/traces/<hex>.json    access traces (chunk indexes in first-read order)
    ROOT/tmp/                 chunks being written
    ROOT/fuse/                the FUSE mount exposing <hex>.erofs files
    ROOT/control.sock         the lazy server's control socket
    ROOT/supervisor.pid, ROOT/server.log

Chunks are named by their digest and shared by every layer that holds them. A chunk file
exists only whole and verified: it is written to ``tmp/``, fsynced and renamed into place
(an interrupted write leaves only a temp file, removed at the next start). A cache from
another layout version is discarded at open (everything in it can be fetched again),
never misread; a non-empty directory without a layout file is refused, since it may be
someone else's data.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from layerfs.errors import StoreError
from layerfs.manifest import check_digest

LAYOUT = "layerfs-lazy-cache 1\n"
_DIRS = ("chunks", "layers", "traces", "tmp", "fuse")


class CacheFullError(StoreError):
    """The cache's disk is full (ENOSPC) even after evicting what could be evicted."""


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """Chunk files in the cache and their bytes."""

    chunks: int
    bytes: int


class ChunkCache:
    """The cache at ``root`` (created if absent). ``limit`` is the size in bytes the
    chunks may take (``None``: no limit); enforcing it is the lazy server's job, since
    only it knows which chunks mounted layers need. ``server``: opened by the lazy server
    itself, which must not look at its own mount. Raises :class:`StoreError` for a
    directory that is not a cache."""

    def __init__(self, root: str | os.PathLike[str], *, limit: int | None = None,
                 server: bool = False) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.limit = limit
        self._open(server)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _open(self, server: bool) -> None:
        os.makedirs(self.root, exist_ok=True)
        lay = self.path("layout")
        try:
            with open(lay) as f:
                found: str | None = f.read()
        except FileNotFoundError:
            found = None
        if found is None and any(n not in ("fuse",) for n in os.listdir(self.root)):
            raise StoreError(errno.EEXIST, f"cache {self.root}: not a layerfs lazy cache (no "
                                           f"layout file, not empty); refusing to use it")
        if found is not None and found != LAYOUT:
            # Another layout: its files are re-fetchable, so drop them rather than guess.
            for name in os.listdir(self.root):
                if name in ("fuse", "control.sock", "supervisor.pid"):
                    continue
                p = self.path(name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
        for d in _DIRS:
            # The server never touches fuse/: it is its own mount, and any access there
            # before the server answers FUSE_INIT would wait on itself forever.
            if not (server and d == "fuse"):
                os.makedirs(self.path(d), exist_ok=True)
        if found != LAYOUT:
            for i in range(256):
                os.makedirs(self.path("chunks", f"{i:02x}"), exist_ok=True)
            self._atomic_write(self.root, "layout", LAYOUT.encode())
        for name in os.listdir(self.path("tmp")):
            with contextlib.suppress(OSError):
                os.unlink(self.path("tmp", name))

    def _atomic_write(self, directory: str, name: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=name + ".", dir=self.path("tmp"))
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, os.path.join(directory, name))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    # -- chunks -------------------------------------------------------------------------

    def chunk_path(self, digest: str) -> str:
        """Where chunk ``digest`` lives (whether or not it is cached)."""
        hexd = check_digest(digest)[7:]
        return self.path("chunks", hexd[:2], hexd)

    def has(self, digest: str) -> bool:
        return os.path.exists(self.chunk_path(digest))

    def put(self, digest: str, data: bytes) -> str:
        """Store verified chunk bytes atomically; returns the chunk's path.

        Raises :class:`CacheFullError` on ENOSPC (nothing is left behind) and
        :class:`StoreError` on other I/O errors."""
        path = self.chunk_path(digest)
        try:
            self._atomic_write(os.path.dirname(path), os.path.basename(path), data)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise CacheFullError(errno.ENOSPC, f"cache {self.root}: disk full writing "
                                                   f"chunk {digest}") from None
            raise StoreError(exc.errno, f"cache {self.root}: writing chunk {digest}: "
                                        f"{exc.strerror}") from None
        return path

    def remove(self, digest: str) -> int:
        """Delete chunk ``digest``; returns the bytes freed (0 if it was absent)."""
        path = self.chunk_path(digest)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return size

    def chunks(self) -> Iterator[tuple[str, int]]:
        """Every cached chunk as ``(digest, bytes)``."""
        base = self.path("chunks")
        for sub in sorted(os.listdir(base)):
            d = os.path.join(base, sub)
            for name in os.listdir(d):
                with contextlib.suppress(FileNotFoundError):
                    yield "sha256:" + name, os.stat(os.path.join(d, name)).st_size

    def usage(self) -> CacheUsage:
        n = total = 0
        for _, size in self.chunks():
            n += 1
            total += size
        return CacheUsage(n, total)

    # -- registry and traces ------------------------------------------------------------

    def save_layer(self, digest: str, record: dict[str, Any]) -> None:
        self._atomic_write(self.path("layers"), check_digest(digest)[7:] + ".json",
                           json.dumps(record, sort_keys=True).encode())

    def drop_layer(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path("layers", check_digest(digest)[7:] + ".json"))

    def layers(self) -> dict[str, dict[str, Any]]:
        """Registered layers: digest -> record (``slot``, ``remote``, ``manifest``)."""
        out = {}
        for name in sorted(os.listdir(self.path("layers"))):
            if name.endswith(".json"):
                with open(self.path("layers", name), "rb") as f:
                    out["sha256:" + name[:-5]] = json.loads(f.read())
        return out

    def save_trace(self, digest: str, chunks: list[int]) -> None:
        self._atomic_write(self.path("traces"), check_digest(digest)[7:] + ".json",
                           json.dumps({"chunks": chunks}).encode())

    def trace(self, digest: str) -> list[int]:
        """The recorded access trace of layer ``digest`` (empty if none)."""
        try:
            with open(self.path("traces", check_digest(digest)[7:] + ".json"), "rb") as f:
                return [int(i) for i in json.loads(f.read())["chunks"]]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return []
