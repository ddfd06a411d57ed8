"""The content-addressed chunk store for layers.

A layer (one EROFS image, named ``sha256:<hex>`` of its bytes) is kept as fixed-size chunks,
each named by the sha256 of its uncompressed bytes and zstd-compressed at rest, plus a
:class:`~layerfs.manifest.Manifest`. A chunk already present is never written again, so the
same bytes in several layers (or the same block of zeros many times) are stored once.

Layout on disk (version 1)::

    ROOT/layout-version         "1\\n"; an unknown value is refused, never misread
    ROOT/lock                   flock(2) target (see Concurrency)
    ROOT/chunks/XX/<hex>        zstd frame of one chunk, XX = first two hex digits
    ROOT/manifests/<hex>.json   canonical JSON manifest of layer sha256:<hex>
    ROOT/tmp/                   files being written; anything here at gc time is stale
    ROOT/quarantine/            chunk files :meth:`Store.verify` found corrupt, moved aside

Atomicity. Every file is written to ``tmp/`` (same filesystem), fsynced, renamed into place,
and its directory fsynced before anything that depends on it is written. A layer's chunks
are all durable before its manifest is renamed into place, so a manifest that exists is
complete; a chunk file exists only whole under its own digest, and every read re-hashes it,
so a torn or rotted chunk is caught, never served. A crash mid-add leaves at worst temp files
and chunks that no manifest references; :meth:`Store.gc` removes both.

Concurrency. Writers (:meth:`add_image`, :meth:`remove`, a build's :meth:`session`, a push's
:meth:`put_chunk` and :meth:`put_manifest`) take a
shared ``flock`` on ``ROOT/lock`` for their whole run; :meth:`gc` takes it exclusive. So any
number of adds run together (two adds racing on one chunk both rename identical bytes to the
same name, which is harmless), while gc never sees the window in which an add has written or
deduplicated against a chunk but not yet written the manifest that references it; and
everything in ``tmp/`` when gc holds the lock belongs to a dead writer. A process must not
call gc while it holds a session on the same store (it would wait on itself). Readers take
no lock: a chunk may disappear under a reader only if its last manifest was removed, which
the reader then reports as a missing chunk.

Repair. A chunk file that exists is trusted by adds (they deduplicate against it without
re-reading it), so a corrupt chunk would stay corrupt however often the layer is rebuilt.
:meth:`Store.verify` therefore moves every chunk file it finds corrupt (undecodable, or not
hashing to its name) to ``ROOT/quarantine/<hex>.<ns>``, re-checked under the writer lock
just before, and reports it; the next add or push of the same data then writes the chunk
anew. Quarantined files are kept for inspection and never read; ``gc`` leaves them (remove
them by hand). A missing chunk needs no move: the next add restores it.

A push arrives chunk by chunk, then its manifest: :meth:`put_chunk` each hold the lock only
for one chunk, so a gc may run between a pushed chunk and its manifest and remove the chunk
(nothing references it yet); :meth:`put_manifest` then refuses, naming the missing chunks,
and the pusher sends them again, so a manifest never points at an absent chunk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO, TypeVar

import zstandard

from layerfs.defaults import DEFAULT_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from layerfs.defaults import DEFAULT_LEVEL as DEFAULT_LEVEL
from layerfs.defaults import DEFAULT_ROOT as DEFAULT_ROOT
from layerfs.defaults import default_root as default_root
from layerfs.digest import sha256_file as sha256_file
from layerfs.errors import CorruptError, LayerfsError, NotFoundError, StoreError
from layerfs.fsutil import atomic_write, fsync_dir, write_replace
from layerfs.manifest import (
    MAX_CHUNK_SIZE,
    ChunkRef,
    InvalidArgumentError,
    Manifest,
    check_chunk_size,
    check_digest,
    check_kind,
    utc_now_rfc3339,
)
from layerfs.output import atomic_output

LAYOUT_VERSION = "1"
_STORE_DIRS = ("chunks", "manifests", "tmp")

Progress = Callable[[int, int], None]
"""Progress callback: ``(bytes_done, bytes_total)``."""

T = TypeVar("T")
R = TypeVar("R")


class RejectedError(LayerfsError, ValueError):
    """The store refused pushed input: chunk bytes that do not match the digest they
    were sent under, or a manifest whose chunks are not all stored (``missing`` lists
    their digests, each once, in manifest order)."""

    def __init__(self, message: str, missing: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


@dataclass(frozen=True, slots=True)
class AddResult:
    """What :meth:`Store.ingest` did: the manifest, how many chunks (and compressed bytes)
    it newly wrote, how many it found already stored, and the wall time in seconds."""

    manifest: Manifest
    new_chunks: int
    new_bytes: int
    reused_chunks: int
    seconds: float


@dataclass(slots=True)
class VerifyReport:
    """Result of :meth:`Store.verify`.

    ``bad_chunks`` maps a chunk digest to why it failed (missing, unreadable, digest
    mismatch); ``bad_layers`` maps a layer digest to why it failed (a bad chunk, a whole-image
    digest mismatch, a corrupt manifest). ``quarantined`` maps each corrupt chunk moved
    aside to its path under ``ROOT/quarantine`` (see Repair in the module docstring).
    ``ok`` is True when ``bad_chunks`` and ``bad_layers`` are empty.
    """

    layers_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    bad_chunks: dict[str, str] = field(default_factory=dict)
    bad_layers: dict[str, str] = field(default_factory=dict)
    quarantined: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.bad_chunks and not self.bad_layers


@dataclass(slots=True)
class GcReport:
    """Result of :meth:`Store.gc`: chunks kept (referenced) and removed (unreferenced),
    bytes freed, stale temp files removed, and ``skipped``: paths under ``chunks/`` that
    are not chunk files (a stray directory, a foreign name), left alone. With ``dry_run``
    nothing was removed and the figures say what would have been."""

    dry_run: bool = False
    chunks_kept: int = 0
    chunks_removed: int = 0
    bytes_freed: int = 0
    temp_removed: int = 0
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes and counts actually on disk: distinct chunk files and their compressed bytes,
    and manifests."""

    chunks: int
    chunk_bytes: int
    layers: int


def _ordered_map(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T],
                 window: int) -> Iterator[R]:
    """``map`` over a pool, results in input order, at most ``window`` items in flight (so
    memory stays bounded whatever the length of ``items``)."""
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        for f in pending:
            with contextlib.suppress(BaseException):
                f.result()


class Store:
    """A chunk store rooted at ``root`` (default :func:`default_root`).

    ``create``: make the layout if ``root`` does not exist or is empty; without it a
    missing store raises :class:`NotFoundError`. ``chunk_size`` (bytes, power of two, 4 KiB
    to 64 MiB) and ``level`` (zstd level) apply to images added later; ``workers`` threads
    hash and compress chunks (hashlib and zstandard release the GIL).

    Raises :class:`StoreError` if ``root`` is not a layerfs store or has a layout version
    this code does not know.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, create: bool = True,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, level: int = DEFAULT_LEVEL,
                 workers: int | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root) if root is not None else default_root())
        self.chunk_size = check_chunk_size(chunk_size)
        if not -7 <= level <= 22:
            raise InvalidArgumentError(f"zstd level {level} is out of range (-7..22)")
        self.level = level
        self.workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
        self._tls = threading.local()
        self._open_layout(create)

    # -- layout -------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _open_layout(self, create: bool) -> None:
        vfile = self._path("layout-version")
        try:
            with open(vfile, "rb") as f:
                raw = f.read(64)
        except FileNotFoundError:
            raw = None
        except OSError as exc:
            raise StoreError(exc.errno, f"store {self.root}: {exc.strerror}") from None
        if raw is not None:
            version = raw.decode("ascii", "replace").strip()
            if version != LAYOUT_VERSION:
                raise StoreError(
                    f"store {self.root}: layout version {version!r} is not one this layerfs "
                    f"knows ({LAYOUT_VERSION}); refusing to use it")
            return
        try:
            present = set(os.listdir(self.root))
        except FileNotFoundError:
            present = None
        except NotADirectoryError:
            raise StoreError(f"store {self.root}: not a directory") from None
        if present is None and not create:
            raise NotFoundError(f"no layer store at {self.root}")
        # A half-made layout (a crash or a concurrent first use) holds only our own names.
        if present and not present <= {*_STORE_DIRS, "lock"}:
            raise StoreError(
                f"store {self.root}: not a layerfs store (no layout-version file, and the "
                f"directory holds other files); refusing to use it")
        if not create:
            raise NotFoundError(f"no layer store at {self.root} (layout not initialised)")
        try:
            os.makedirs(self.root, exist_ok=True)
            for d in _STORE_DIRS:
                os.makedirs(self._path(d), exist_ok=True)
            for i in range(256):
                os.makedirs(self._path("chunks", f"{i:02x}"), exist_ok=True)
                # Fanout directories exist up front: adding a chunk never creates a
                # directory, so the only directory to fsync for it is its fanout dir.
            for i in range(256):
                fsync_dir(self._path("chunks", f"{i:02x}"))
            for d in _STORE_DIRS:
                fsync_dir(self._path(d))
            self._atomic_write(self.root, "layout-version", (LAYOUT_VERSION + "\n").encode())
        except OSError as exc:
            raise StoreError(exc.errno, f"store {self.root}: creating layout: "
                                        f"{exc.strerror}") from None

    # -- locking ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self, mode: int) -> Iterator[None]:
        fd = os.open(self._path("lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def session(self) -> Iterator[str]:
        """Hold the shared (writer) lock and yield a private temp directory inside the store.

        A build writes its image there, then calls :meth:`add_image`; gc waits until the
        session ends, and the directory (with anything left in it) is removed on exit.
        """
        with self._lock(fcntl.LOCK_SH):
            d = tempfile.mkdtemp(prefix="session.", dir=self._path("tmp"))
            try:
                yield d
            finally:
                _rmtree(d)

    # -- small file helpers -------------------------------------------------------------

    def _atomic_write(self, directory: str, name: str, data: bytes) -> None:
        atomic_write(directory, name, data, tmp_dir=self._path("tmp"))

    def _chunk_path(self, hexd: str) -> str:
        return self._path("chunks", hexd[:2], hexd)

    def _manifest_path(self, digest: str) -> str:
        return self._path("manifests", check_digest(digest)[7:] + ".json")

    def _cctx(self) -> Any:
        c = getattr(self._tls, "cctx", None)
        if c is None:
            c = self._tls.cctx = zstandard.ZstdCompressor(level=self.level,
                                                          write_content_size=True)
        return c

    def _dctx(self) -> Any:
        d = getattr(self._tls, "dctx", None)
        if d is None:
            d = self._tls.dctx = zstandard.ZstdDecompressor()
        return d

    # -- chunks ---------------------------------------------------------------------------

    def _put_chunk(self, data: bytes) -> tuple[str, int, bool]:
        """Store one chunk; returns (digest, stored bytes, newly written)."""
        hexd = hashlib.sha256(data).hexdigest()
        path = self._chunk_path(hexd)
        try:
            return "sha256:" + hexd, os.stat(path).st_size, False
        except FileNotFoundError:
            pass
        comp = self._cctx().compress(data)
        write_replace(path, comp, tmp_dir=self._path("tmp"), prefix="chunk.")
        return "sha256:" + hexd, len(comp), True

    def _decode_chunk(self, digest: str, comp: bytes, where: str) -> bytes:
        try:
            data: bytes = self._dctx().decompress(comp, max_output_size=MAX_CHUNK_SIZE)
        except zstandard.ZstdError as exc:
            raise CorruptError(f"{where}: chunk {digest} does not decompress ({exc})") from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise CorruptError(f"{where}: chunk {digest} does not match its digest")
        return data

    def _load_chunk(self, digest: str, where: str) -> bytes:
        path = self._chunk_path(digest[7:])
        try:
            with open(path, "rb") as f:
                comp = f.read()
        except FileNotFoundError:
            raise CorruptError(f"{where}: chunk {digest} is missing") from None
        except OSError as exc:
            raise StoreError(exc.errno, f"{where}: reading chunk {digest}: "
                                        f"{exc.strerror}") from None
        return self._decode_chunk(digest, comp, where)

    def read_chunk(self, digest: str) -> bytes:
        """The uncompressed bytes of chunk ``digest``, re-hashed before they are returned.

        Raises :class:`NotFoundError` if the store does not hold it, :class:`CorruptError`
        if its file does not decompress or does not match its digest.
        """
        check_digest(digest)
        if not os.path.exists(self._chunk_path(digest[7:])):
            raise NotFoundError(f"chunk {digest} is not in store {self.root}")
        return self._load_chunk(digest, f"store {self.root}")

    def has_chunk(self, digest: str) -> bool:
        """Whether chunk ``digest`` (``sha256:<hex>``) is stored (not re-verified)."""
        return os.path.exists(self._chunk_path(check_digest(digest)[7:]))

    def read_stored_chunk(self, digest: str) -> bytes:
        """The zstd frame of chunk ``digest`` exactly as stored, for serving as is; not
        verified here (whoever decompresses it must re-hash it). Raises
        :class:`NotFoundError` if the store does not hold it."""
        data = self._read_stored(digest, nowait=False)
        assert data is not None
        return data

    def read_stored_chunk_nowait(self, digest: str) -> bytes | None:
        """Like :meth:`read_stored_chunk`, but None instead of waiting for the disk when
        the file's bytes are not all in the page cache (``preadv2(RWF_NOWAIT)``, Linux
        4.14+), so an event loop can read a cached chunk itself and hand only the others
        to a thread."""
        return self._read_stored(digest, nowait=True)

    def _read_stored(self, digest: str, *, nowait: bool) -> bytes | None:
        try:
            with open(self._chunk_path(check_digest(digest)[7:]), "rb") as f:
                if not nowait:
                    return f.read()
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                try:
                    got = os.preadv(f.fileno(), [buf], 0, os.RWF_NOWAIT)
                except BlockingIOError:
                    return None
                return bytes(buf) if got == size else None
        except FileNotFoundError:
            raise NotFoundError(f"chunk {digest} is not in store {self.root}") from None
        except OSError as exc:
            raise StoreError(exc.errno, f"store {self.root}: reading chunk {digest}: "
                                        f"{exc.strerror}") from None

    def put_chunk(self, digest: str, data: bytes) -> bool:
        """Store the uncompressed bytes ``data`` of one pushed chunk under ``digest``;
        True if it was new. The bytes are hashed first and the file is durable (fsynced,
        renamed, directory fsynced) when this returns; takes the shared writer lock for
        the one chunk.

        Raises :class:`RejectedError` if ``data`` does not hash to ``digest`` (nothing is
        written), :class:`InvalidArgumentError` for a malformed digest or a chunk over
        64 MiB, :class:`StoreError` on I/O failure (errno ENOSPC for a full disk)."""
        check_digest(digest)
        if len(data) > MAX_CHUNK_SIZE:
            raise InvalidArgumentError(f"chunk {digest}: {len(data)} bytes is over the "
                                       f"{MAX_CHUNK_SIZE}-byte chunk limit")
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise RejectedError(f"store {self.root}: pushed chunk {digest} does not match "
                                f"its digest")
        with self._lock(fcntl.LOCK_SH):
            try:
                _, _, new = self._put_chunk(data)
                if new:
                    fsync_dir(os.path.dirname(self._chunk_path(digest[7:])))
            except OSError as exc:
                if isinstance(exc, StoreError):
                    raise
                raise StoreError(exc.errno, f"store {self.root}: writing chunk {digest}: "
                                            f"{exc.strerror}") from None
        return new

    def put_manifest(self, manifest: Manifest) -> bool:
        """Record a pushed layer whose chunks were sent with :meth:`put_chunk`; True if
        it was new. Under the shared writer lock, so a gc cannot remove a chunk between
        the check and the write.

        Raises :class:`RejectedError` (with ``missing``) if any chunk it lists is not
        stored, :class:`StoreError` on I/O failure."""
        with self._lock(fcntl.LOCK_SH):
            missing = [d for d in dict.fromkeys(c.digest for c in manifest.chunks)
                       if not os.path.exists(self._chunk_path(d[7:]))]
            if missing:
                raise RejectedError(f"store {self.root}: layer {manifest.digest}: "
                                    f"{len(missing)} chunk(s) not held, e.g. {missing[0]}",
                                    missing)
            if os.path.exists(self._manifest_path(manifest.digest)):
                return False
            try:
                self._atomic_write(self._path("manifests"), manifest.digest[7:] + ".json",
                                   manifest.to_json())
            except OSError as exc:
                raise StoreError(exc.errno, f"store {self.root}: writing manifest "
                                            f"{manifest.digest}: {exc.strerror}") from None
        return True

    # -- layers ---------------------------------------------------------------------------

    def has_layer(self, digest: str) -> bool:
        """Whether the manifest of layer ``digest`` is stored (not re-verified)."""
        return os.path.exists(self._manifest_path(digest))

    def add_image(self, path: str | os.PathLike[str], *, kind: str, source: str,
                  chunk_size: int | None = None, progress: Progress | None = None) -> Manifest:
        """Add the EROFS image at ``path`` as a layer of ``kind``; returns its manifest.

        The image is streamed (memory is bounded by a few chunks per worker, whatever the
        image size). ``source`` is free text recorded in the manifest. If the layer is
        already stored its existing manifest is returned and any missing chunk restored.
        Raises :class:`StoreError` on I/O failure (``errno.ENOSPC`` for a full disk),
        leaving no manifest; see the module docstring for what a failure leaves behind.
        """
        return self.ingest(path, kind=kind, source=source, chunk_size=chunk_size,
                           progress=progress).manifest

    def ingest(self, path: str | os.PathLike[str], *, kind: str, source: str,
               chunk_size: int | None = None, progress: Progress | None = None) -> AddResult:
        """Like :meth:`add_image`, returning also what was written (an :class:`AddResult`)."""
        check_kind(kind)
        csize = check_chunk_size(chunk_size if chunk_size is not None else self.chunk_size)
        path = os.fspath(path)
        where = f"store {self.root}: adding {path}"
        t0 = time.monotonic()
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed in the finally below
        except OSError as exc:
            raise StoreError(exc.errno, f"{where}: {exc.strerror}") from None
        with self._lock(fcntl.LOCK_SH), f:
            total = os.fstat(f.fileno()).st_size
            whole = hashlib.sha256()
            refs: list[ChunkRef] = []
            seen: set[str] = set()
            new_chunks = new_bytes = reused = done = 0

            def chunks() -> Iterator[bytes]:
                nonlocal done
                while True:
                    block = f.read(csize)
                    if not block:
                        return
                    whole.update(block)
                    done += len(block)
                    yield block

            try:
                with ThreadPoolExecutor(self.workers, thread_name_prefix="lfs-add") as pool:
                    for cdig, stored, new in _ordered_map(pool, self._put_chunk, chunks(),
                                                          self.workers * 2):
                        # Two workers may both write one chunk (zeros, say) that is new
                        # to the store; it is new once.
                        if new and cdig not in seen:
                            new_chunks += 1
                            new_bytes += stored
                        else:
                            reused += 1
                        seen.add(cdig)
                        refs.append(ChunkRef(cdig, stored))
                        if progress is not None:
                            progress(done, total)
                # Chunks are renamed into place; make the renames durable before the
                # manifest that points at them can be.
                for d in sorted({r.digest[7:9] for r in refs}):
                    fsync_dir(self._path("chunks", d))
                digest = "sha256:" + whole.hexdigest()
                m = Manifest(digest=digest, size=done, chunk_size=csize, chunks=tuple(refs),
                             kind=kind, source=source, created=utc_now_rfc3339())
                try:
                    existing = self.manifest(digest)
                except (NotFoundError, CorruptError):
                    existing = None
                if existing is not None and existing.chunk_size == csize:
                    m = existing
                else:
                    self._atomic_write(self._path("manifests"), digest[7:] + ".json",
                                       m.to_json())
            except OSError as exc:
                if isinstance(exc, StoreError):
                    raise
                what = exc.strerror or str(exc)
                if exc.errno == errno.ENOSPC:
                    what = "no space left on device; the layer was not added"
                raise StoreError(exc.errno, f"{where}: {what}") from None
        return AddResult(m, new_chunks, new_bytes, reused, time.monotonic() - t0)

    def manifest(self, digest: str) -> Manifest:
        """The manifest of layer ``digest``.

        Raises :class:`NotFoundError` if it is not stored, :class:`CorruptError` if the
        stored manifest is damaged or names another layer.
        """
        path = self._manifest_path(digest)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise NotFoundError(f"layer {digest} is not in store {self.root}") from None
        except OSError as exc:
            raise StoreError(exc.errno, f"reading manifest {path}: {exc.strerror}") from None
        m = Manifest.from_json(data, where=f"manifest {path}")
        if m.digest != digest:
            raise CorruptError(f"manifest {path}: names layer {m.digest}, not {digest}")
        return m

    def digests(self) -> list[str]:
        """Digests of every stored layer, sorted."""
        out = []
        for name in os.listdir(self._path("manifests")):
            if name.endswith(".json") and len(name) == 69:
                out.append("sha256:" + name[:64])
        return sorted(out)

    def layers(self) -> list[Manifest]:
        """Manifests of every stored layer, oldest first (then by digest).

        Raises :class:`CorruptError` if a manifest is damaged (:meth:`scan_layers` lists
        the others instead).
        """
        ms, bad = self.scan_layers()
        if bad:
            raise CorruptError(next(iter(bad.values())))
        return ms

    def scan_layers(self) -> tuple[list[Manifest], dict[str, str]]:
        """``(manifests, bad)``: the readable manifests, oldest first (then by digest),
        and for each damaged one its digest mapped to why (never raises for damage)."""
        ms: list[Manifest] = []
        bad: dict[str, str] = {}
        for d in self.digests():
            try:
                ms.append(self.manifest(d))
            except NotFoundError:  # removed while we listed
                continue
            except (CorruptError, InvalidArgumentError) as exc:
                bad[d] = str(exc)
        return sorted(ms, key=lambda m: (m.created, m.digest)), bad

    def resolve(self, ref: str) -> str:
        """Full digest of the one stored layer whose digest starts with ``ref`` (with or
        without ``sha256:``, at least 4 hex digits). Raises :class:`NotFoundError` for no
        match and :class:`InvalidArgumentError` for an ambiguous or malformed prefix."""
        hexp = ref[7:] if ref.startswith("sha256:") else ref
        if len(hexp) < 4 or any(c not in "0123456789abcdef" for c in hexp):
            raise InvalidArgumentError(f"{ref!r} is not a layer digest or digest prefix")
        hits = [d for d in self.digests() if d[7:].startswith(hexp)]
        if not hits:
            raise NotFoundError(f"layer {ref} is not in store {self.root}")
        if len(hits) > 1:
            raise InvalidArgumentError(f"{ref!r} is ambiguous: matches {len(hits)} layers")
        return hits[0]

    def remove(self, digest: str) -> None:
        """Forget layer ``digest`` (its manifest). Its chunks stay until :meth:`gc`, since
        other layers may share them. Raises :class:`NotFoundError` if not stored."""
        path = self._manifest_path(digest)
        with self._lock(fcntl.LOCK_SH):
            try:
                os.unlink(path)
            except FileNotFoundError:
                raise NotFoundError(f"layer {digest} is not in store {self.root}") from None
            fsync_dir(self._path("manifests"))

    def _iter_layer(self, m: Manifest, pool: ThreadPoolExecutor,
                    where: str) -> Iterator[tuple[ChunkRef, bytes]]:
        def load(ref: ChunkRef) -> tuple[ChunkRef, bytes]:
            return ref, self._load_chunk(ref.digest, where)
        return _ordered_map(pool, load, m.chunks, self.workers * 2)

    def export(self, digest: str, out: str | os.PathLike[str] | BinaryIO | IO[bytes],
               *, progress: Progress | None = None) -> Manifest:
        """Reassemble layer ``digest`` into ``out`` (a path, replaced atomically, or a
        binary file object), checking every chunk's digest and the whole image's digest.

        A path must be new or a regular file (mode 0644 minus umask); anything else there
        (a device such as ``/dev/null``, a FIFO, a symlink, a directory) is refused with
        :class:`~layerfs.output.OutputError` and left as it was (:mod:`layerfs.output`).
        Raises :class:`NotFoundError` if the layer is not stored and :class:`CorruptError`
        if a chunk or the whole is wrong; a path ``out`` is then left untouched.
        """
        m = self.manifest(digest)
        if isinstance(out, (str, os.PathLike)):
            with atomic_output(out) as fd, os.fdopen(os.dup(fd), "wb") as f:
                self._export_to(m, f, progress)
        else:
            self._export_to(m, out, progress)
        return m

    def _export_to(self, m: Manifest, f: IO[bytes], progress: Progress | None) -> None:
        where = f"layer {m.digest}"
        whole = hashlib.sha256()
        done = 0
        with ThreadPoolExecutor(self.workers, thread_name_prefix="lfs-export") as pool:
            for i, (ref, data) in enumerate(self._iter_layer(m, pool, where)):
                if len(data) != m.chunk_length(i):
                    raise CorruptError(f"{where}: chunk {i} ({ref.digest}) has {len(data)} "
                                       f"bytes, the manifest says {m.chunk_length(i)}")
                whole.update(data)
                f.write(data)
                done += len(data)
                if progress is not None:
                    progress(done, m.size)
        if "sha256:" + whole.hexdigest() != m.digest:
            raise CorruptError(f"{where}: reassembled image does not match the layer digest")

    def verify(self, digest: str | None = None, *, progress: Progress | None = None,
               quarantine: bool = True) -> VerifyReport:
        """Re-hash every chunk of layer ``digest`` (or of every layer) and each whole image.

        Never raises for damage: the report names each bad chunk and bad layer. With
        ``quarantine`` each corrupt chunk file is moved aside so that adding the same data
        again repairs it (Repair in the module docstring; ``report.quarantined``). Raises
        :class:`NotFoundError` if a named layer is not stored.
        """
        rep = VerifyReport()
        digests = [digest] if digest is not None else self.digests()
        if digest is not None:
            self.manifest(digest)  # NotFoundError before any work
        with ThreadPoolExecutor(self.workers, thread_name_prefix="lfs-verify") as pool:
            for d in digests:
                try:
                    m = self.manifest(d)
                except NotFoundError:
                    continue
                except CorruptError as exc:
                    rep.bad_layers[d] = str(exc)
                    continue
                rep.layers_checked += 1
                whole = hashlib.sha256()
                broken = None
                check = functools.partial(self._check_chunk, m)
                for ref, res in _ordered_map(pool, check, enumerate(m.chunks),
                                             self.workers * 2):
                    rep.chunks_checked += 1
                    if isinstance(res, str):
                        rep.bad_chunks[ref.digest] = res
                        broken = broken or f"chunk {ref.digest} {res}"
                        continue
                    rep.bytes_checked += len(res)
                    whole.update(res)
                    if progress is not None:
                        progress(rep.bytes_checked, 0)
                if broken is not None:
                    rep.bad_layers[d] = broken
                elif "sha256:" + whole.hexdigest() != d:
                    rep.bad_layers[d] = "reassembled image does not match the layer digest"
        if quarantine:
            self._quarantine(rep)
        return rep

    def _quarantine(self, rep: VerifyReport) -> None:
        corrupt = [c for c, why in rep.bad_chunks.items() if not why.startswith(
            ("is missing", "has "))]  # missing: nothing to move; a length is the manifest's
        if not corrupt:
            return
        qdir = self._path("quarantine")
        with self._lock(fcntl.LOCK_SH):
            os.makedirs(qdir, exist_ok=True)
            for c in corrupt:
                path = self._chunk_path(c[7:])
                try:
                    self._load_chunk(c, "quarantine")
                    continue  # rewritten meanwhile (only ever whole and valid)
                except CorruptError:
                    pass
                except StoreError:
                    continue
                dest = os.path.join(qdir, f"{c[7:]}.{time.time_ns()}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, dest)
                    rep.quarantined[c] = dest
            fsync_dir(qdir)

    def _check_chunk(self, m: Manifest, item: tuple[int, ChunkRef]) -> tuple[ChunkRef, bytes | str]:
        i, ref = item
        try:
            data = self._load_chunk(ref.digest, "verify")
        except StoreError as exc:  # CorruptError included
            return ref, str(exc).removeprefix(f"verify: chunk {ref.digest} ")
        if len(data) != m.chunk_length(i):
            return ref, f"has {len(data)} bytes, want {m.chunk_length(i)}"
        return ref, data

    def usage(self) -> Usage:
        """Distinct chunk files and their bytes on disk, and the number of layers."""
        n = total = 0
        for path in self._chunk_files():
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_size
                n += 1
        return Usage(n, total, len(self.digests()))

    def _chunk_files(self, skipped: list[str] | None = None) -> Iterator[str]:
        """Paths of the chunk files: regular files named by 64 hex digits in the fanout
        directory of their first two. Anything else is left alone and, if ``skipped`` is
        given, appended to it."""
        base = self._path("chunks")
        for sub in sorted(os.listdir(base)):
            d = os.path.join(base, sub)
            if not os.path.isdir(d) or os.path.islink(d) or not _is_hex(sub, 2):
                if skipped is not None:
                    skipped.append(d)
                continue
            with os.scandir(d) as it:
                for e in sorted(it, key=lambda e: e.name):
                    if (e.is_file(follow_symlinks=False) and _is_hex(e.name, 64)
                            and e.name.startswith(sub)):
                        yield e.path
                    elif skipped is not None:
                        skipped.append(e.path)

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Remove chunks that no manifest references and stale temp files.

        Takes the store lock exclusively, so it waits for running adds and builds to
        finish. Raises :class:`CorruptError` (removing nothing) if any manifest is damaged,
        since the chunks it references cannot be known.
        """
        rep = GcReport(dry_run=dry_run)
        with self._lock(fcntl.LOCK_EX):
            live: set[str] = set()
            for d in self.digests():
                for ref in self.manifest(d).chunks:
                    live.add(ref.digest[7:])
            touched: set[str] = set()
            for path in self._chunk_files(rep.skipped):
                name = os.path.basename(path)
                if name in live:
                    rep.chunks_kept += 1
                    continue
                try:
                    size = os.stat(path).st_size
                    if not dry_run:
                        os.unlink(path)
                except FileNotFoundError:
                    continue
                rep.chunks_removed += 1
                rep.bytes_freed += size
                touched.add(os.path.dirname(path))
            tmp = self._path("tmp")
            for name in os.listdir(tmp):
                rep.temp_removed += 1
                if not dry_run:
                    _rmtree(os.path.join(tmp, name))
            if not dry_run:
                for d in sorted(touched):
                    fsync_dir(d)
        return rep


def _is_hex(name: str, n: int) -> bool:
    return len(name) == n and all(c in "0123456789abcdef" for c in name)


def _rmtree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
