"""Build layers: a source (directory, tar stream, OCI image layout) → EROFS image → store.

The image is written to a temp file next to its final place (in the store's session
directory, or beside ``output``), added to the store from there, and then renamed to
``output`` (or dropped), so neither the store nor ``output`` ever holds a partial result.
File data of big files is aligned by the writer to the store's chunk size, so that the same
large file in two layers falls on the same chunks and is stored once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layerfs.defaults import DEFAULT_CHUNK_SIZE
from layerfs.digest import sha256_fd, sha256_while
from layerfs.errors import InvalidSourceError, NotFoundError
from layerfs.manifest import InvalidArgumentError, Manifest, check_chunk_size, check_kind
from layerfs.output import STDOUT, check_output, copy_to_stdout, make_durable, replace_with
from layerfs.writer import WriterInput, WriterOptions, write_image

if TYPE_CHECKING:  # a build from a directory without a store imports neither
    from layerfs.store import Store
    from layerfs.tree import Tree

MAX_SOURCE_DATE_EPOCH = (1 << 63) - 1
"""Largest ``SOURCE_DATE_EPOCH`` (seconds): EROFS extended inodes and the writer keep
seconds in a signed 64-bit field (``csrc/include/erofs_fs.h``)."""

BuildProgress = Callable[[str, int, int], None]
"""Progress callback: ``(stage, bytes_done, bytes_total)``; stage is ``"store"``."""


@dataclass(frozen=True, slots=True)
class BuildResult:
    """One built layer.

    ``digest`` (``sha256:<hex>``) and ``size`` (bytes) are the image's; ``manifest`` is the
    store's record (None without a store); ``output`` the image path written (or None);
    ``stats`` the writer's :class:`~layerfs.writer.ImageStats`; ``new_chunks`` /
    ``reused_chunks`` what the store wrote or found; times are wall seconds.
    """

    digest: str
    size: int
    kind: str
    source: str
    output: str | None
    manifest: Manifest | None
    stats: Any
    new_chunks: int
    new_bytes: int
    reused_chunks: int
    write_seconds: float
    store_seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (what ``layerfs build --json`` prints per layer)."""
        st = self.stats
        stats = st._asdict() if hasattr(st, "_asdict") else dict(vars(st))
        for k, v in stats.items():
            if isinstance(v, bytes):  # the uuid
                stats[k] = _uuid_text(v) if len(v) == 16 else v.hex()
        return {
            "digest": self.digest, "size": self.size, "kind": self.kind,
            "source": self.source, "output": self.output,
            "stored": self.manifest is not None,
            "chunks": len(self.manifest.chunks) if self.manifest else None,
            "new_chunks": self.new_chunks, "new_bytes": self.new_bytes,
            "reused_chunks": self.reused_chunks,
            "write_seconds": round(self.write_seconds, 6),
            "store_seconds": round(self.store_seconds, 6),
            "image": stats,
        }


def _uuid_text(b: bytes) -> str:
    """The 16 bytes ``b`` as a uuid string (what ``str(uuid.UUID(bytes=b))`` gives,
    without importing ``uuid``: start-up time)."""
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def writer_options(options: WriterOptions | None, chunk_size: int,
                   environ: dict[str, str] | None = None, *,
                   clamp_mtime: bool = False) -> WriterOptions:
    """The writer options for a build: ``options`` (or the defaults) with the chunk
    alignment set to the store's chunk size and, with ``clamp_mtime`` and no clamp given
    in ``options``, mtimes clamped to ``SOURCE_DATE_EPOCH`` (seconds,
    reproducible-builds.org convention; like ``tar --clamp-mtime``).

    Clamping is asked for, never implied by the variable alone (BuildKit's
    ``rewrite-timestamp`` is opt-in for the same reason): it changes files' mtimes, and
    caches keyed on them go stale in every sandbox, notably timestamp-based ``.pyc``
    files (Debian's), which Python then recompiles from source at every start.

    Raises :class:`InvalidArgumentError` naming the variable for a ``SOURCE_DATE_EPOCH``
    that is unset (with ``clamp_mtime``) or not a non-negative decimal integer of at most
    :data:`MAX_SOURCE_DATE_EPOCH`.
    """
    env = os.environ if environ is None else environ
    opts = options if options is not None else WriterOptions()
    opts = opts._replace(chunk_align=chunk_size)
    sde = env.get("SOURCE_DATE_EPOCH")
    if clamp_mtime and opts.clamp_mtime_ns is None:
        if sde is None:
            raise InvalidArgumentError("clamping mtimes needs SOURCE_DATE_EPOCH (seconds) "
                                       "in the environment")
        text = sde.strip()
        # Digits only: int() would also take "-5", "+5" and "1_000".
        if not text.isascii() or not text.isdigit() or int(text) > MAX_SOURCE_DATE_EPOCH:
            raise InvalidArgumentError(
                f"SOURCE_DATE_EPOCH={sde!r} is not a number of seconds from 0 to "
                f"{MAX_SOURCE_DATE_EPOCH}")
        secs = int(text)
        opts = opts._replace(clamp_mtime_ns=secs * 1_000_000_000)
    return opts


@dataclass(frozen=True, slots=True)
class _Job:
    tree: Tree | WriterInput    # a directory is written from its scan as is
    source: str
    output: str | None


def _emit(job: _Job, *, kind: str, store: Store | None, opts: WriterOptions,
          chunk_size: int, scratch: str, progress: BuildProgress | None) -> BuildResult:
    where = (os.path.dirname(job.output) if job.output and job.output != STDOUT
             else scratch)
    fd, tmp = tempfile.mkstemp(prefix=".layerfs-build.", suffix=".erofs", dir=where)
    durable = store is None and bool(job.output) and job.output != STDOUT
    try:
        t0 = time.monotonic()
        try:
            # Into the temp file itself: the store reads it back and drops it (nothing
            # to fsync); an output is made durable before it is renamed into place.
            stats = write_image(job.tree, fd, opts, writeback=bool(job.output)
                                and job.output != STDOUT)
            t1 = time.monotonic()
            if durable:  # its fsync runs while it is hashed (both without the GIL)
                digest = sha256_while(fd, make_durable)
            elif store is None:
                digest = sha256_fd(fd)
        finally:
            os.close(fd)
        manifest = None
        new_chunks = new_bytes = reused = 0
        if store is not None:
            cb = (lambda d, t: progress("store", d, t)) if progress is not None else None
            added = store.ingest(tmp, kind=kind, source=job.source, chunk_size=chunk_size,
                                 progress=cb)
            manifest = added.manifest
            new_chunks, new_bytes, reused = (added.new_chunks, added.new_bytes,
                                             added.reused_chunks)
            digest, size = manifest.digest, manifest.size
        else:
            size = stats.size
        t2 = time.monotonic()
        if job.output == STDOUT:
            copy_to_stdout(tmp)
        elif job.output:
            replace_with(tmp, job.output, durable=durable)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return BuildResult(digest=digest, size=size, kind=kind, source=job.source,
                       output=job.output, manifest=manifest, stats=stats,
                       new_chunks=new_chunks, new_bytes=new_bytes, reused_chunks=reused,
                       write_seconds=t1 - t0, store_seconds=t2 - t1)


@contextlib.contextmanager
def _scratch(store: Store | None) -> Iterator[str]:
    if store is not None:
        with store.session() as d:
            yield d
    else:
        d = tempfile.mkdtemp(prefix="layerfs-build.")
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)


def _parse_oci(src: str) -> tuple[str, str | None]:
    rest = src[4:]
    # A ref may itself contain ':' (name:tag); a layout directory path normally does not,
    # so the first ':' after a path that exists splits them.
    if os.path.isdir(rest):
        return rest, None
    layout, sep, ref = rest.partition(":")
    if not sep or not os.path.isdir(layout):
        raise NotFoundError(f"{src}: no OCI layout directory {layout!r}")
    return layout, ref or None


def build_layers(src: str, *, kind: str, store: Store | None, output: str | None = None,
                 options: WriterOptions | None = None, flatten: bool = False,
                 chunk_size: int | None = None, clamp_mtime: bool = False,
                 progress: BuildProgress | None = None) -> list[BuildResult]:
    """Build one layer per source layer and return them in order.

    ``src``: a directory; a tar file (plain, gzip or zstd); ``"-"`` for a tar on stdin; or
    ``oci:LAYOUT_DIR[:REF]`` (one layer per OCI layer, bottom first, or one flattened layer
    with ``flatten``). ``store``: where to add the layers (None: only write ``output``).
    ``output``: the image path for one layer (``"-"``: stdout, not a terminal); for
    several OCI layers a directory that receives ``layer-<index>.erofs``. An existing
    output that is not a regular file (a device, FIFO, symlink, directory) is refused
    with :class:`~layerfs.output.OutputError` before any work (see
    :mod:`layerfs.output`); images get mode 0644 minus the umask. ``chunk_size``
    (bytes) defaults to the store's. ``clamp_mtime``: mtimes later than
    ``SOURCE_DATE_EPOCH`` become it (see :func:`writer_options`).
    At least one of ``store`` and ``output`` is required.

    Raises :class:`InvalidSourceError` for a bad source (naming the entry),
    :class:`NotFoundError` for a missing one, :class:`InvalidArgumentError` for bad
    arguments, :class:`~layerfs.errors.StoreError` for store failures. On any error no
    layer of this call that failed is in the store and ``output`` is untouched.
    """
    return _build(src, kind=kind, store=store, output=output, options=options,
                  flatten=flatten, chunk_size=chunk_size, clamp_mtime=clamp_mtime,
                  progress=progress, single=False)


def _build(src: str, *, kind: str, store: Store | None, output: str | None,
           options: WriterOptions | None, flatten: bool, chunk_size: int | None,
           clamp_mtime: bool, progress: BuildProgress | None,
           single: bool) -> list[BuildResult]:
    check_kind(kind)
    if store is None and output is None:
        raise InvalidArgumentError("build needs a store or an output path (or both)")
    csize = check_chunk_size(chunk_size if chunk_size is not None
                             else store.chunk_size if store is not None
                             else DEFAULT_CHUNK_SIZE)
    opts = writer_options(options, csize, clamp_mtime=clamp_mtime)
    out = output if output is None or output == STDOUT else os.path.abspath(output)
    if out is not None and out != STDOUT and not os.path.isdir(os.path.dirname(out)):
        raise NotFoundError(f"{output}: directory {os.path.dirname(out)} does not exist")
    if output is not None and not (src.startswith("oci:") and os.path.isdir(output)):
        check_output(output)  # before any work; a multi-layer OCI output is a directory
    with _scratch(store) as scratch:
        jobs: list[_Job] = []
        if src.startswith("oci:"):
            from layerfs.sources.oci import load_oci

            layout, ref = _parse_oci(src)
            layers = load_oci(layout, ref, workdir=scratch, flatten=flatten)
            if len(layers) == 1:
                outs: list[str | None] = [out]
            elif out == STDOUT:
                raise InvalidArgumentError(
                    f"{src}: has {len(layers)} layers; -o - takes one (use --flatten)")
            elif out is not None:
                os.makedirs(out, exist_ok=True)
                outs = [os.path.join(out, f"layer-{lay.index}.erofs") for lay in layers]
            else:
                outs = [None] * len(layers)
            base = f"oci:{os.path.abspath(layout)}" + (f":{ref}" if ref else "")
            for lay, o in zip(layers, outs, strict=True):
                what = ("flattened" if flatten else f"layer {lay.index} {lay.blob_digest}")
                jobs.append(_Job(lay.tree, f"{base} {what}", o))
        elif src == "-":
            from layerfs.sources.tar import load_tar

            jobs.append(_Job(load_tar(sys.stdin.buffer, workdir=scratch, name="<stdin>"),
                             "tar:-", out))
        elif os.path.isdir(src):
            from layerfs.sources.directory import scan_directory

            jobs.append(_Job(scan_directory(src), f"dir:{os.path.abspath(src)}", out))
        elif os.path.isfile(src):
            from layerfs.sources.tar import load_tar

            jobs.append(_Job(load_tar(src, workdir=scratch), f"tar:{os.path.abspath(src)}",
                             out))
        elif os.path.exists(src):
            raise InvalidSourceError(f"{src}: not a directory, tar file or oci: layout")
        else:
            raise NotFoundError(f"{src}: no such file or directory")
        for j in jobs:
            if j.output is not None:
                check_output(j.output)
        if single and len(jobs) != 1:
            raise InvalidArgumentError(
                f"{src}: has {len(jobs)} layers; use build_layers() or flatten=True")
        return [_emit(j, kind=kind, store=store, opts=opts, chunk_size=csize,
                      scratch=scratch, progress=progress) for j in jobs]


def build_tree(tree: Tree, *, kind: str, store: Store, source: str,
               options: WriterOptions | None = None) -> BuildResult:
    """Write ``tree`` (e.g. :func:`layerfs.sources.upper.load_upper`'s) as one layer into
    ``store``; ``source`` is recorded in its manifest. The files the tree points at must
    not change until this returns (the writer refuses one that did). Raises what
    :func:`build_layers` raises; on error nothing is added."""
    check_kind(kind)
    csize = check_chunk_size(store.chunk_size)
    opts = writer_options(options, csize)
    with _scratch(store) as scratch:
        return _emit(_Job(tree, source, None), kind=kind, store=store, opts=opts,
                     chunk_size=csize, scratch=scratch, progress=None)


def build_layer(src: str, *, kind: str, store: Store | None, output: str | None = None,
                options: WriterOptions | None = None, flatten: bool = False,
                chunk_size: int | None = None, clamp_mtime: bool = False,
                progress: BuildProgress | None = None) -> BuildResult:
    """Build exactly one layer (see :func:`build_layers` for the arguments and errors).

    Raises :class:`InvalidArgumentError` if ``src`` is an OCI layout with several layers
    and ``flatten`` is not set.
    """
    return _build(src, kind=kind, store=store, output=output, options=options,
                  flatten=flatten, chunk_size=chunk_size, clamp_mtime=clamp_mtime,
                  progress=progress, single=True)[0]
