"""The node's lazy-loading cache directory: chunks fetched from remotes, kept uncompressed
in one sparse file per layer, so that a cached read is a plain ``pread`` at the same offset
in the C file server.

Layout (version 2)::

    ROOT/layout               "layerfs-lazy-cache 2\\n"
    ROOT/data/<hex>.img       layer sha256:<hex>: a sparse file of the layer's size, each
                              chunk at its own offset, chunks not cached are holes
    ROOT/data/<hex>.present   which chunks of it are present and verified (see below)
    ROOT/layers/<hex>.json    registered layers: {"slot", "remote", "manifest"}
    ROOT/slots.json           {"high": N}: every layer slot the FUSE connection may have
                              handed out is below N (see layerfs.lazy.server)
    ROOT/traces/<hex>.json    access traces (chunk indexes in first-read order)
    ROOT/tmp/                 small files being written
    ROOT/fuse/                the FUSE mount exposing <hex>.erofs files
    ROOT/control.sock         the lazy server's control socket
    ROOT/supervisor.pid, ROOT/server.log

A chunk's bytes are verified against its digest, written at its offset and marked present
(for readers, at once). The ``.present`` bitmap is a snapshot of those marks taken BEFORE
an fdatasync of the layer file and then replaced atomically (temp file, fsync, rename), so
a bit set on disk never names bytes that a crash could have lost or torn; it lags the
marks by at most a second (a crash then costs refetches). Eviction
clears the bit and persists the bitmap before punching the hole
(``fallocate(PUNCH_HOLE)``). A bitmap that does not match its layer (size, chunk size,
checksum) is ignored: the chunks are fetched again, never misread.

A cache from another layout version (version 1 kept one file per chunk) is discarded at
open (everything in it can be fetched again), never misread; a non-empty directory
without a layout file is refused, since it may be someone else's data.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from layerfs.errors import StoreError
from layerfs.fsutil import atomic_write
from layerfs.manifest import check_digest

log = logging.getLogger("layerfs.lazy")
_HEX64 = re.compile(r"[0-9a-f]{64}")

LAYOUT = "layerfs-lazy-cache 2\n"
_DIRS = ("data", "layers", "traces", "tmp", "fuse")
_PRESENT_MAGIC = b"layerfs-present 1\n"
_PRESENT_HEAD = struct.Struct("<QII")  # layer size, chunk size, chunk count


class CacheFullError(StoreError):
    """The cache's disk is full (ENOSPC) even after evicting what could be evicted."""


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """Layer cache files in the cache and the bytes they take on disk (holes excluded)."""

    layers: int
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
            self._atomic_write(self.root, "layout", LAYOUT.encode())
        for name in os.listdir(self.path("tmp")):
            with contextlib.suppress(OSError):
                os.unlink(self.path("tmp", name))

    def _atomic_write(self, directory: str, name: str, data: bytes) -> None:
        atomic_write(directory, name, data, tmp_dir=self.path("tmp"))

    # -- layer cache files ---------------------------------------------------------------

    def data_path(self, digest: str) -> str:
        """The sparse cache file of layer ``digest`` (whether or not it exists)."""
        return self.path("data", check_digest(digest)[7:] + ".img")

    def present_path(self, digest: str) -> str:
        """The persisted present-chunk bitmap of layer ``digest``."""
        return self.path("data", check_digest(digest)[7:] + ".present")

    def save_present(self, digest: str, size: int, chunk_size: int, nchunks: int,
                     bits: bytes) -> None:
        """Persist the present bitmap of layer ``digest`` (bit i, LSB first, = chunk i)
        atomically. Raises :class:`CacheFullError` on ENOSPC, :class:`StoreError` else."""
        if len(bits) != (nchunks + 7) // 8:
            raise ValueError(f"bitmap of {len(bits)} bytes for {nchunks} chunks")
        body = _PRESENT_MAGIC + _PRESENT_HEAD.pack(size, chunk_size, nchunks) + bits
        try:
            self._atomic_write(self.path("data"), check_digest(digest)[7:] + ".present",
                               body + struct.pack("<I", zlib.crc32(body)))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise CacheFullError(errno.ENOSPC, f"cache {self.root}: disk full writing "
                                                   f"the bitmap of {digest}") from None
            raise StoreError(exc.errno, f"cache {self.root}: writing the bitmap of {digest}: "
                                        f"{exc.strerror}") from None

    def load_present(self, digest: str, size: int, chunk_size: int, nchunks: int) -> bytes:
        """The persisted bitmap of layer ``digest``; all zeros if there is none or it
        does not describe this layer (wrong shape or checksum)."""
        want = (nchunks + 7) // 8
        try:
            with open(self.present_path(digest), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return bytes(want)
        head = len(_PRESENT_MAGIC) + _PRESENT_HEAD.size
        if (len(raw) != head + want + 4 or not raw.startswith(_PRESENT_MAGIC)
                or struct.unpack("<I", raw[-4:])[0] != zlib.crc32(raw[:-4])
                or _PRESENT_HEAD.unpack(raw[len(_PRESENT_MAGIC):head])
                != (size, chunk_size, nchunks)):
            return bytes(want)
        return raw[head:-4]

    def drop_data(self, digest: str) -> int:
        """Delete the cache file and bitmap of layer ``digest`` (bitmap first, so a crash
        in between leaves no bits naming a missing file); returns the bytes freed."""
        freed = self.data_bytes(digest)
        for p in (self.present_path(digest), self.data_path(digest)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        return freed

    def data_bytes(self, digest: str) -> int:
        """Bytes the cache file of layer ``digest`` takes on disk (0 if absent)."""
        try:
            return os.stat(self.data_path(digest)).st_blocks * 512
        except FileNotFoundError:
            return 0

    def cached_layers(self) -> list[str]:
        """Digests of the layers that have a cache file."""
        return sorted("sha256:" + n[:-4] for n in os.listdir(self.path("data"))
                      if n.endswith(".img") and _HEX64.fullmatch(n[:-4]))

    def usage(self) -> CacheUsage:
        digests = self.cached_layers()
        return CacheUsage(len(digests), sum(self.data_bytes(d) for d in digests))

    # -- registry and traces ------------------------------------------------------------

    def save_layer(self, digest: str, record: dict[str, Any]) -> None:
        self._atomic_write(self.path("layers"), check_digest(digest)[7:] + ".json",
                           json.dumps(record, sort_keys=True).encode())

    def drop_layer(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path("layers", check_digest(digest)[7:] + ".json"))

    def layers(self) -> dict[str, dict[str, Any]]:
        """Registered layers: digest -> record (``slot``, ``remote``, ``manifest``; or
        ``slot`` and ``removed``). A record that cannot be read is left out (logged)."""
        out = {}
        for name in sorted(os.listdir(self.path("layers"))):
            if not name.endswith(".json"):
                continue
            try:
                with open(self.path("layers", name), "rb") as f:
                    rec = json.loads(f.read())
                slot = rec.get("slot") if isinstance(rec, dict) else None
                if not isinstance(slot, int) or isinstance(slot, bool) or \
                        not 0 <= slot < (1 << 31):
                    raise ValueError(f"slot {slot!r}")
                out["sha256:" + check_digest("sha256:" + name[:-5])[7:]] = rec
            except (OSError, ValueError) as exc:
                log.warning("cache %s: layer record %s is unreadable (%s); ignored",
                            self.root, name, exc)
        return out

    def slots_high(self) -> int | None:
        """The persisted slot high-water mark (``None`` if none was saved)."""
        try:
            with open(self.path("slots.json"), "rb") as f:
                high = json.loads(f.read())["high"]
            return high if isinstance(high, int) and high >= 0 else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save_slots_high(self, high: int) -> None:
        """Persist the slot high-water mark (durably: a restarted server relies on it)."""
        self._atomic_write(self.root, "slots.json", json.dumps({"high": high}).encode())

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
