"""``layerfs`` subcommands for remotes and lazy loading: serve, push, mount, umount,
stats, prefetch. Registered into :mod:`layerfs.cli` by :func:`add_parsers`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
from typing import Any

from layerfs.defaults import default_root
from layerfs.errors import LayerfsError
from layerfs.manifest import check_digest
from layerfs.progress import human_bytes


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add this module's subcommands to the ``layerfs`` subparsers ``sub``."""
    from layerfs.lazy import default_cache  # not .client: the parser is built on every run

    s = sub.add_parser("serve", parents=[common], help="serve the store to nodes (HTTP)")
    s.add_argument("--listen", required=True, type=_listen_arg, metavar="HOST:PORT|unix:PATH")

    p = sub.add_parser("push", parents=[common], help="copy a layer to a remote")
    p.add_argument("digest", metavar="DIGEST")
    p.add_argument("--to", required=True, metavar="URL",
                   help="http://HOST:PORT, unix:PATH or a shared directory")
    p.add_argument("--concurrency", type=int, default=8)

    cache = argparse.ArgumentParser(add_help=False)
    cache.add_argument("--cache", metavar="DIR", default=None,
                       help=f"node cache (default $LAYERFS_CACHE or {default_cache()})")

    m = sub.add_parser("mount", parents=[common, cache],
                       help="mount a layer lazily (chunks fetched on first read)")
    m.add_argument("digest", metavar="DIGEST")
    m.add_argument("mountpoint", metavar="MOUNTPOINT")
    m.add_argument("--remote", required=True, metavar="URL")
    m.add_argument("--foreground", action="store_true",
                   help="stay attached; unmount on SIGINT/SIGTERM")
    m.add_argument("--fetch-timeout", type=float, default=30.0, metavar="S",
                   help="a read waiting for a chunk fails with EIO after S seconds")
    m.add_argument("--cache-limit", type=int, default=None, metavar="BYTES")
    m.add_argument("--prefetch", action="store_true",
                   help="replay the layer's recorded access trace in the background")

    u = sub.add_parser("umount", parents=[common, cache], help="unmount a lazy layer")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("--keep-server", action="store_true",
                   help="leave the node's lazy server running when nothing is mounted")

    sub.add_parser("stats", parents=[common, cache], help="lazy loading metrics per layer")

    f = sub.add_parser("prefetch", parents=[common, cache],
                       help="fetch a layer's recorded chunks in the background")
    f.add_argument("digest", metavar="DIGEST")
    f.add_argument("--save-trace", action="store_true",
                   help="record the chunks read so far as the layer's prefetch list instead")


def _listen_arg(text: str) -> str:
    """``unix:PATH`` or ``HOST:PORT`` (port 0-65535; 0 picks a free one)."""
    if text.startswith("unix:"):
        if len(text) > 5:
            return text
    else:
        host, _, port = text.rpartition(":")
        v6 = host.startswith("[") and host.endswith("]") and len(host) > 2
        if host and (v6 or ":" not in host) and port.isascii() and port.isdigit() and \
                int(port) <= 65535:
            return text
    raise argparse.ArgumentTypeError(f"{text!r}: want HOST:PORT (port 0-65535; [IPv6]:PORT) "
                                     "or unix:PATH")


def _emit(args: argparse.Namespace, obj: dict[str, Any], human: str) -> None:
    if args.json:
        sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    else:
        sys.stdout.write(human.rstrip("\n") + "\n")
    sys.stdout.flush()


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio  # here, not at the top: every `layerfs` run would pay ~40 ms for it

    from layerfs.remote.server import serve_forever
    from layerfs.store import Store

    store = Store(args.store or default_root(), create=True)

    def ready(url: str) -> None:
        _emit(args, {"url": url, "store": store.root}, f"serving {store.root} on {url}")

    async def run() -> None:
        task = asyncio.ensure_future(serve_forever(store, args.listen, ready))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
    except OSError as exc:  # bind: in use, no such directory, not permitted
        raise OSError(exc.errno, f"listen {args.listen}: {exc.strerror or exc}") from None
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    import asyncio

    from layerfs.progress import Bar
    from layerfs.remote import open_remote, push
    from layerfs.store import Store

    store = Store(args.store or default_root(), create=False)
    digest = store.resolve(args.digest)

    async def run() -> Any:
        async with open_remote(args.to, **({"create": True} if not args.to.startswith(
                ("http://", "https://", "unix:")) else {})) as r:
            with Bar("pushing") as bar:
                return await push(store, digest, r, concurrency=args.concurrency,
                                  progress=bar)

    res = asyncio.run(run())
    _emit(args, {"digest": digest, "to": args.to, "sent_chunks": res.sent_chunks,
                 "sent_bytes": res.sent_bytes, "skipped_chunks": res.skipped_chunks,
                 "manifest_new": res.manifest_new, "seconds": res.seconds},
          f"pushed {digest} to {args.to}: {res.sent_chunks} chunk(s) sent "
          f"({human_bytes(res.sent_bytes)}), {res.skipped_chunks} already there"
          + ("" if res.manifest_new else " (layer was already complete)"))
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from layerfs.lazy import client
    from layerfs.mount import mount_erofs, umount

    digest = check_digest(args.digest)
    if not os.path.exists(args.mountpoint):
        raise FileNotFoundError(errno.ENOENT, f"{args.mountpoint}: no such directory")
    if not os.path.isdir(args.mountpoint):
        raise NotADirectoryError(errno.ENOTDIR, f"{args.mountpoint}: not a directory")
    if os.path.ismount(os.path.realpath(args.mountpoint)):
        raise LayerfsError(f"{args.mountpoint}: something is mounted there already")
    proc = client.start(args.cache, fetch_timeout=args.fetch_timeout,
                        cache_limit=args.cache_limit)
    c = client.LazyClient(args.cache)
    try:
        info = c.register(digest, args.remote)
        mount_erofs(info["file"], args.mountpoint)
    except BaseException:
        if proc is not None:
            client.stop(c.cache, proc=proc)
        raise
    queued = c.prefetch(digest) if args.prefetch else 0
    _emit(args, {"digest": digest, "mountpoint": os.path.abspath(args.mountpoint),
                 "file": info["file"], "size": info["size"], "cache": c.cache,
                 "prefetch_queued": queued},
          f"mounted {digest} on {args.mountpoint} (lazy, {human_bytes(info['size'])}, "
          f"cache {c.cache})")
    if not args.foreground:
        return 0
    import asyncio

    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    asyncio.run(wait())
    try:
        umount(args.mountpoint)
    except OSError:
        umount(args.mountpoint, lazy=True)
    _finish(c, digest)
    return 0


def _finish(c: Any, digest: str | None, keep: bool = False) -> None:
    """Record the layer's access trace for the next prefetch; stop the node's lazy
    server if no EROFS mount uses its files any more."""
    from layerfs.lazy import client

    if digest is not None:
        with contextlib.suppress(LayerfsError):
            c.trace(digest, save=True, reset=True)
    fuse = os.path.join(c.cache, "fuse") + "/"
    if not keep and not any(src.startswith(fuse) for src, _ in _erofs_mounts()):
        client.stop(c.cache)


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _erofs_mounts() -> list[tuple[str, str]]:
    """(source, mountpoint) of every EROFS mount in this mount namespace."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = right.split()
            if len(fields) >= 2 and fields[0] == "erofs":
                out.append((_unescape(fields[1]), _unescape(left.split()[4])))
    return out


def cmd_umount(args: argparse.Namespace) -> int:
    from layerfs.lazy import client
    from layerfs.mount import umount

    mp = os.path.realpath(args.mountpoint)
    src = next((s for s, m in _erofs_mounts() if m == mp), None)
    if src is None:
        raise LayerfsError(f"{mp}: no EROFS mount there")
    cache = args.cache or os.path.dirname(os.path.dirname(src))
    digest = None
    name = os.path.basename(src)
    if name.endswith(".erofs") and len(name) == 70:
        digest = "sha256:" + name[:64]
    umount(mp)
    _finish(client.LazyClient(cache), digest, keep=args.keep_server)
    _emit(args, {"unmounted": mp, "layer": digest}, f"unmounted {mp}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from layerfs.lazy.client import LazyClient

    st = LazyClient(args.cache).stats()
    slots = st.get("slots") or {}
    lines = [f"cache {st['cache']['root']}: {human_bytes(st['cache']['bytes'])}"
             + (f" of {human_bytes(st['cache']['limit'])}" if st["cache"]["limit"] else ""),
             f"layer slots: {slots.get('live', 0)} registered, {slots.get('held', 0)} "
             f"removed but held by the kernel, {slots.get('reusable', 0)} reusable, "
             f"{slots.get('pinned', 0)} pinned (used before a restart), of "
             f"{slots.get('max', 0)}",
             f"{'LAYER':<20} {'SIZE':>10} {'FETCHED':>10} {'READ%':>6} {'HIT%':>6} "
             f"{'CHUNKS':>13} {'INFLIGHT':>8}"]
    for d, layer in sorted(st["layers"].items()):
        lines.append(f"{d[:19]:<20} {human_bytes(layer['size']):>10} "
                     f"{human_bytes(layer['bytes_fetched']):>10} "
                     f"{100 * layer['fraction_fetched']:>5.1f}% "
                     f"{100 * layer['hit_ratio']:>5.1f}% "
                     f"{layer['present_chunks']:>6}/{layer['chunks']:<6} "
                     f"{layer['inflight']:>8}")
    _emit(args, st, "\n".join(lines))
    return 0


def cmd_prefetch(args: argparse.Namespace) -> int:
    from layerfs.lazy.client import LazyClient

    c = LazyClient(args.cache)
    digest = check_digest(args.digest)
    if args.save_trace:
        chunks = c.trace(digest, save=True)
        _emit(args, {"digest": digest, "saved": len(chunks)},
              f"recorded {len(chunks)} chunk(s) as the prefetch list of {digest}")
        return 0
    n = c.prefetch(digest)
    _emit(args, {"digest": digest, "queued": n},
          f"prefetching {n} chunk(s) of {digest} in the background")
    return 0


COMMANDS = {"serve": cmd_serve, "push": cmd_push, "mount": cmd_mount, "umount": cmd_umount,
            "stats": cmd_stats, "prefetch": cmd_prefetch}
