"""Shared pieces of the lazy-loading tests: a chunk server on loopback in a thread (with
knobs to slow it down and count requests), a test tree, a lazy node, mount checks."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import os
import pathlib
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from layerfs.lazy import client
from layerfs.mount import mount_erofs, umount
from layerfs.remote.server import make_app
from layerfs.store import Store

CHUNK = 64 << 10


class RemoteThread:
    """``layerfs serve`` for ``store`` on 127.0.0.1 in a background thread.

    ``delay``: seconds every chunk GET waits first. ``gets``: chunk GETs per digest."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.delay = 0.0
        self.gets: collections.Counter[str] = collections.Counter()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._port = 0

    def _run(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)  # type: ignore[arg-type]

    def start(self) -> str:
        if not self._thread.is_alive():
            self._thread.start()
        self._run(self._start())
        return self.url

    async def _start(self) -> None:
        app = make_app(self.store)

        @web.middleware
        async def watch(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
            if request.method == "GET" and request.path.startswith("/v1/chunks/"):
                self.gets[request.path.rsplit("/", 1)[1]] += 1
                if self.delay:
                    await asyncio.sleep(self.delay)
            return await handler(request)

        app.middlewares.append(watch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        self._port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self._port}"

    def stop(self) -> None:
        """Stop listening (the same port is reused by a later :meth:`start`)."""
        if self._runner is not None:
            self._run(self._runner.cleanup())
            self._runner = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def make_tree(root: pathlib.Path) -> pathlib.Path:
    """A tree of ~6 MiB: small files, a few large random ones, a symlink, a hardlink."""
    root.mkdir()
    (root / "etc").mkdir()
    (root / "etc" / "hostname").write_text("node\n")
    (root / "etc" / "motd").write_bytes(b"welcome\n" * 100)
    (root / "bin").mkdir()
    seed = b"seed"
    for i in range(6):
        out = bytearray()
        while len(out) < (1 << 20) + i * 4097:
            seed = hashlib.sha256(seed).digest()
            out += seed * 128
        (root / "bin" / f"tool{i}").write_bytes(bytes(out[:(1 << 20) + i * 4097]))
        os.chmod(root / "bin" / f"tool{i}", 0o755)
    (root / "lib").mkdir()
    for i in range(200):
        (root / "lib" / f"mod{i:03d}.py").write_text(f"# module {i}\n" + "x = 1\n" * i)
    os.symlink("tool0", root / "bin" / "link")
    os.link(root / "etc" / "motd", root / "etc" / "motd2")
    return root


def snapshot(root: str) -> dict[str, Any]:
    """Everything observable about a tree: type, mode, owner, size, mtime, content hash,
    link target, and hardlink groups."""
    out: dict[str, Any] = {}
    inodes: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*sorted(dirnames), *sorted(filenames)]:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            rec: dict[str, Any] = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid,
                                   "mtime": st.st_mtime_ns}
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    rec["sha"] = hashlib.sha256(f.read()).hexdigest()
                rec["size"] = st.st_size
                rec["link_of"] = inodes.setdefault(st.st_ino, rel)
            elif stat.S_ISLNK(st.st_mode):
                rec["target"] = os.readlink(p)
            out[rel] = rec
    return out


@contextlib.contextmanager
def lazy_node(cache: pathlib.Path, **kw: Any) -> Iterator[client.LazyClient]:
    """A running lazy server for ``cache``; stopped, and its mount checked gone, on exit."""
    proc = client.start(str(cache), **kw)
    try:
        yield client.LazyClient(str(cache))
    finally:
        client.stop(str(cache), proc=proc)
        assert str(cache / "fuse") not in pathlib.Path("/proc/mounts").read_text()


@contextlib.contextmanager
def mounted(image: str, mp: pathlib.Path) -> Iterator[str]:
    mp.mkdir(exist_ok=True)
    mount_erofs(image, mp)
    try:
        yield str(mp)
    finally:
        try:
            umount(mp)
        except OSError:
            umount(mp, lazy=True)
