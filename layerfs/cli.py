"""The ``layerfs`` command: build, inspect, list, verify, collect and export layers.

Human output on stdout by default; ``--json`` prints exactly one JSON object per command.
Progress bars go to stderr, only when it is a terminal. Exit status: 0 success, 1 error (one
line on stderr, no traceback for expected errors), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from layerfs import cli_remote
from layerfs.defaults import DEFAULT_LEVEL, default_root
from layerfs.digest import sha256_file
from layerfs.errors import LayerfsError, NotFoundError
from layerfs.manifest import KINDS, Manifest, check_chunk_size
from layerfs.output import STDOUT, check_output
from layerfs.progress import Bar, human_bytes

if TYPE_CHECKING:  # imported where a command opens it: a build without one does not
    from layerfs.store import Store


class _UsageError(Exception):
    pass


def _size_arg(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]i?B?)?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1048576, 64K, 1M)")
    unit = (m.group(2) or "").upper()[:1]
    n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]
    try:
        return check_chunk_size(n)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS keeps a subcommand from resetting a value given before the subcommand.
    common.add_argument("--store", metavar="DIR", default=argparse.SUPPRESS,
                        help=f"layer store (default $LAYERFS_STORE or {default_root()})")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON object instead of human output")

    p = argparse.ArgumentParser(
        prog="layerfs", parents=[common],
        description="Build and keep content-addressed EROFS layers.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    b = sub.add_parser("build", parents=[common], help="build a layer from a source")
    b.add_argument("src", metavar="SRC",
                   help="a directory, a tar file (plain/gzip/zstd), '-' for a tar on stdin, "
                        "or oci:LAYOUT_DIR[:REF]")
    b.add_argument("--kind", required=True, choices=KINDS)
    b.add_argument("-o", "--output", metavar="IMAGE.erofs",
                   help="also write the image here (a directory for several OCI layers; "
                        "- for stdout); an existing non-regular file is refused")
    b.add_argument("--no-store", action="store_true",
                   help="only write -o, do not add to the store")
    b.add_argument("--flatten", action="store_true",
                   help="OCI: one layer from all OCI layers instead of one per OCI layer")
    b.add_argument("--chunk-size", type=_size_arg, metavar="N",
                   help="store chunk size and big-file alignment (default 256K)")
    b.add_argument("--clamp-mtime", action="store_true",
                   help="mtimes later than $SOURCE_DATE_EPOCH become it (reproducible "
                        "layers from fresh files; makes timestamp-based .pyc stale)")
    b.add_argument("--level", type=int, default=DEFAULT_LEVEL,
                   help=f"zstd level for new chunks (default {DEFAULT_LEVEL})")

    i = sub.add_parser("inspect", parents=[common], help="show a stored layer or image file")
    i.add_argument("target", metavar="DIGEST|IMAGE.erofs")

    sub.add_parser("ls", parents=[common], help="list the layers in the store")

    v = sub.add_parser("verify", parents=[common], help="re-hash stored chunks")
    v.add_argument("digest", nargs="?", metavar="DIGEST")

    g = sub.add_parser("gc", parents=[common], help="remove unreferenced chunks")
    g.add_argument("--dry-run", action="store_true", help="only report what would go")

    e = sub.add_parser("export", parents=[common], help="reassemble a layer's image")
    e.add_argument("digest", metavar="DIGEST")
    e.add_argument("-o", "--output", required=True, metavar="IMAGE.erofs",
                   help="where to write the image (- for stdout); an existing "
                        "non-regular file (device, FIFO, symlink, directory) is refused")

    r = sub.add_parser("rm", parents=[common], help="remove a layer (chunks go at gc)")
    r.add_argument("digest", metavar="DIGEST")
    cli_remote.add_parsers(sub, common)  # serve, push, mount, umount, stats, prefetch
    return p


def _emit(args: argparse.Namespace, obj: dict[str, Any], human: str) -> None:
    # With `-o -` stdout carries the image; the report goes to stderr.
    out = sys.stderr if getattr(args, "output", None) == STDOUT else sys.stdout
    if args.json:
        out.write(json.dumps(obj, sort_keys=True) + "\n")
    elif human:
        out.write(human.rstrip("\n") + "\n")


def _open_store(args: argparse.Namespace, *, create: bool = False, **kw: Any) -> Store:
    from layerfs.store import Store

    return Store(args.store or default_root(), create=create, **kw)


def _short(digest: str) -> str:
    return digest[:19]


def _rate(n: float, secs: float) -> float:
    return n / secs if secs > 0 else 0.0


def cmd_build(args: argparse.Namespace) -> int:
    from layerfs.build import build_layers

    if args.no_store and not args.output:
        raise _UsageError("--no-store needs -o IMAGE.erofs")
    store = None
    if not args.no_store:
        kw: dict[str, Any] = {"level": args.level}
        if args.chunk_size:
            kw["chunk_size"] = args.chunk_size
        store = _open_store(args, create=True, **kw)
    with Bar("storing") as bar:
        results = build_layers(args.src, kind=args.kind, store=store, output=args.output,
                               flatten=args.flatten, chunk_size=args.chunk_size,
                               clamp_mtime=args.clamp_mtime,
                               progress=lambda _stage, d, t: bar(d, t))
    lines = []
    for res in results:
        secs = res.write_seconds
        files = getattr(res.stats, "files", 0) or 0
        line = (f"{res.digest}  {res.kind}  {human_bytes(res.size)}  "
                f"written in {secs:.2f} s ({human_bytes(_rate(res.size, secs))}/s, "
                f"{_rate(files, secs):.0f} files/s)")
        if res.manifest is not None:
            line += (f"; stored {len(res.manifest.chunks)} chunks ({res.new_chunks} new, "
                     f"{human_bytes(res.new_bytes)} written, {res.reused_chunks} reused) "
                     f"in {res.store_seconds:.2f} s")
        if res.output:
            line += f" -> {res.output}"
        lines.append(line)
    dicts = [r.to_dict() for r in results]
    obj: dict[str, Any] = dicts[0] if len(dicts) == 1 else {"layers": dicts}
    if store is not None:
        obj["store"] = store.root
    _emit(args, obj, "\n".join(lines))
    return 0


def _manifest_human(m: Manifest, root: str) -> str:
    return "\n".join([
        f"digest:      {m.digest}",
        f"kind:        {m.kind}",
        f"size:        {m.size} ({human_bytes(m.size)})",
        f"chunks:      {len(m.chunks)} x {human_bytes(m.chunk_size)}, "
        f"{len({c.digest for c in m.chunks})} distinct, "
        f"{human_bytes(m.stored_size)} stored",
        f"source:      {m.source}",
        f"created:     {m.created}",
        f"store:       {root}",
    ])


def _manifest_dict(m: Manifest, *, chunks: bool) -> dict[str, Any]:
    d = m.to_dict()
    if not chunks:
        del d["chunks"]
    d["chunk_count"] = len(m.chunks)
    d["stored_size"] = m.stored_size
    return d


def cmd_inspect(args: argparse.Namespace) -> int:
    target = args.target
    if os.path.isfile(target):
        from layerfs.imageinfo import read_superblock

        sb = read_superblock(target)
        digest = sha256_file(target)
        size = os.path.getsize(target)
        stored: bool | None = None
        try:
            stored = _open_store(args).has_layer(digest)
        except (NotFoundError, LayerfsError):
            stored = None
        obj = {"digest": digest, "size": size, "path": os.path.abspath(target),
               "in_store": stored, "superblock": sb.to_dict()}
        human = "\n".join([
            f"image:       {os.path.abspath(target)}",
            f"digest:      {digest}",
            f"size:        {size} ({human_bytes(size)})",
            f"in store:    {'yes' if stored else 'no' if stored is False else '(no store)'}",
            f"block size:  {sb.block_size}",
            f"blocks:      {sb.blocks}",
            f"inodes:      {sb.inodes}",
            f"root nid:    {sb.root_nid}",
            f"features:    {' '.join(sb.features) or '(none)'}",
            f"uuid:        {sb.uuid}",
            f"epoch:       {sb.epoch}.{sb.epoch_nsec:09d}",
            "checksum:    " + {True: "ok", False: "BAD", None: "(none)"}[sb.checksum_ok],
        ])
        _emit(args, obj, human)
        return 0 if sb.checksum_ok is not False else 1
    if not re.fullmatch(r"(sha256:)?[0-9a-f]{4,64}", target):
        raise NotFoundError(f"{target}: no such image file, and not a layer digest")
    store = _open_store(args)
    m = store.manifest(store.resolve(target))
    _emit(args, _manifest_dict(m, chunks=True), _manifest_human(m, store.root))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = _open_store(args)
    ms, bad = store.scan_layers()
    rows = [("DIGEST", "KIND", "SIZE", "CHUNKS", "CREATED", "SOURCE")]
    for m in ms:
        rows.append((_short(m.digest), m.kind, human_bytes(m.size), str(len(m.chunks)),
                     m.created, m.source))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    human = "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True))
                      + "  " + r[5] for r in rows)
    use = store.usage()
    human += (f"\n{len(ms)} layers, {human_bytes(sum(m.size for m in ms))} of images in "
              f"{use.chunks} chunks, {human_bytes(use.chunk_bytes)} on disk")
    _emit(args, {"store": store.root, "layers": [_manifest_dict(m, chunks=False) for m in ms],
                 "chunks": use.chunks, "chunk_bytes": use.chunk_bytes, "bad_layers": bad},
          human)
    for digest, why in sorted(bad.items()):
        sys.stderr.write(f"layerfs: layer {digest}: damaged manifest, not listed: {why}\n")
    return 1 if bad else 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _open_store(args)
    digest = store.resolve(args.digest) if args.digest else None
    with Bar("verifying") as bar:
        rep = store.verify(digest, progress=bar)
    lines = [f"{d}: {why}" for d, why in sorted(rep.bad_layers.items())]
    lines += [f"chunk {d}: {why}" for d, why in sorted(rep.bad_chunks.items())]
    lines += [f"chunk {d}: moved to {p}; adding the layer again rewrites it"
              for d, p in sorted(rep.quarantined.items())]
    verdict = "ok" if rep.ok else "FAILED"
    lines.append(f"{verdict}: {rep.layers_checked} layers, {rep.chunks_checked} chunks, "
                 f"{human_bytes(rep.bytes_checked)} checked; {len(rep.bad_layers)} bad "
                 f"layers, {len(rep.bad_chunks)} bad chunks")
    _emit(args, {"ok": rep.ok, "layers_checked": rep.layers_checked,
                 "chunks_checked": rep.chunks_checked, "bytes_checked": rep.bytes_checked,
                 "bad_layers": rep.bad_layers, "bad_chunks": rep.bad_chunks,
                 "quarantined": rep.quarantined},
          "\n".join(lines))
    if not rep.ok:
        sys.stderr.write(f"layerfs: verify found {len(rep.bad_layers)} bad layers and "
                         f"{len(rep.bad_chunks)} bad chunks\n")
    return 0 if rep.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    store = _open_store(args)
    rep = store.gc(dry_run=args.dry_run)
    verb = "would remove" if rep.dry_run else "removed"
    _emit(args, {"dry_run": rep.dry_run, "chunks_kept": rep.chunks_kept,
                 "chunks_removed": rep.chunks_removed, "bytes_freed": rep.bytes_freed,
                 "temp_removed": rep.temp_removed, "skipped": rep.skipped},
          f"{verb} {rep.chunks_removed} chunks ({human_bytes(rep.bytes_freed)}) and "
          f"{rep.temp_removed} temp files; kept {rep.chunks_kept} chunks"
          + "".join(f"\nskipped {p}: not a chunk file" for p in rep.skipped))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    store = _open_store(args)
    digest = store.resolve(args.digest)
    with Bar("exporting") as bar:
        if args.output == STDOUT:
            check_output(STDOUT)
            m = store.export(digest, sys.stdout.buffer, progress=bar)
            sys.stdout.buffer.flush()
        else:
            m = store.export(digest, args.output, progress=bar)
    out = args.output if args.output == STDOUT else os.path.abspath(args.output)
    _emit(args, {"digest": m.digest, "size": m.size, "output": out},
          f"{m.digest}  {human_bytes(m.size)} -> {out}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = _open_store(args)
    digest = store.resolve(args.digest)
    store.remove(digest)
    _emit(args, {"removed": digest},
          f"removed {digest} (its unshared chunks go at the next `layerfs gc`)")
    return 0


_COMMANDS = {"build": cmd_build, "inspect": cmd_inspect, "ls": cmd_ls, "verify": cmd_verify,
             "gc": cmd_gc, "export": cmd_export, "rm": cmd_rm, **cli_remote.COMMANDS}


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        msg = exc.strerror
        if exc.filename is not None:
            msg = f"{exc.filename}: {msg}"
        return msg
    return str(exc) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.store = getattr(args, "store", None)
    args.json = getattr(args, "json", False)
    try:
        return _COMMANDS[args.cmd](args)
    except _UsageError as exc:
        parser.error(str(exc))  # exits 2
    except (LayerfsError, OSError) as exc:
        sys.stderr.write(f"layerfs: {_message(exc)}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("layerfs: interrupted\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
