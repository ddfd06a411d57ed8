"""The chunk server (``layerfs serve``): a layerfs store over HTTP (aiohttp).

Protocol: see :mod:`layerfs.remote.http`. Chunks are served from the store's zstd files;
``GET /v1/chunks/{digest}`` answers the uncompressed bytes (verified by the store before
they leave) unless the client accepts ``application/zstd``, in which case the stored frame
goes out as is and the client verifies after decompressing. Single byte ranges
(``Range: bytes=a-b``, ``a-``, ``-n``) apply to whichever representation is sent.
Pushed chunks and manifests are verified on receipt (:mod:`layerfs.remote.storeio`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from layerfs.errors import CorruptError, LayerfsError, NotFoundError, StoreError
from layerfs.manifest import MAX_CHUNK_SIZE, Manifest, check_digest
from layerfs.remote import storeio
from layerfs.remote.base import PushRejectedError, decompress_chunk
from layerfs.store import Store

log = logging.getLogger("layerfs.serve")

ZSTD_TYPE = "application/zstd"
STORE_KEY = web.AppKey("store", Store)
_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)")
_MAX_BODY = MAX_CHUNK_SIZE + (1 << 20)


def _error(status: int, code: str, message: str, **extra: Any) -> web.Response:
    body = {"error": {"code": code, "message": message, **extra}}
    return web.json_response(body, status=status)


def _digest(request: web.Request) -> str:
    d = request.match_info["digest"]
    try:
        return check_digest(d)
    except ValueError as exc:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"code": "bad_digest", "message": str(exc)}}),
            content_type="application/json") from None


def _ranged(request: web.Request, data: bytes, content_type: str) -> web.Response:
    """``data`` as a 200, or the requested single byte range as a 206 (416 if invalid)."""
    size = len(data)
    head = {"Accept-Ranges": "bytes"}
    rng = request.headers.get("Range")
    if rng is None:
        # aiohttp answers HEAD with these headers and no body.
        return web.Response(body=data, content_type=content_type, headers=head)
    m = _RANGE_RE.fullmatch(rng.strip())
    start: int
    end: int
    if m and (m.group(1) or m.group(2)):
        if m.group(1):
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        else:  # suffix range: the last n bytes
            start = max(0, size - int(m.group(2)))
            end = size - 1
        if start <= end and start < size:
            head["Content-Range"] = f"bytes {start}-{end}/{size}"
            return web.Response(status=206, body=data[start:end + 1],
                                content_type=content_type, headers=head)
    return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})


def _handler(fn: Callable[[web.Request, Store], Awaitable[web.StreamResponse]]) -> Callable[
        [web.Request], Awaitable[web.StreamResponse]]:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        store = request.app[STORE_KEY]
        try:
            return await fn(request, store)
        except NotFoundError as exc:
            return _error(404, "not_found", str(exc))
        except PushRejectedError as exc:
            if exc.missing:
                return _error(409, "missing_chunks", str(exc), missing=exc.missing)
            return _error(400, "rejected", str(exc))
        except CorruptError as exc:
            log.error("%s", exc)
            return _error(500, "corrupt", str(exc))
        except StoreError as exc:
            log.error("%s", exc)
            code = 507 if exc.errno == 28 else 500  # ENOSPC: Insufficient Storage
            return _error(code, "store_error", str(exc))
        except (LayerfsError, ValueError) as exc:
            return _error(400, "bad_request", str(exc))
    return wrapped


async def _get_layer(request: web.Request, store: Store) -> web.StreamResponse:
    digest = _digest(request)
    m = await asyncio.to_thread(store.manifest, digest)
    body = m.to_json()
    return web.Response(body=body, content_type="application/json",
                        headers={"ETag": f'"{digest}"'})


async def _list_layers(request: web.Request, store: Store) -> web.StreamResponse:
    return web.json_response({"layers": await asyncio.to_thread(store.digests)})


async def _put_layer(request: web.Request, store: Store) -> web.StreamResponse:
    digest = _digest(request)
    m = Manifest.from_json(await request.read(), where=f"pushed manifest {digest}")
    if m.digest != digest:
        raise PushRejectedError(f"pushed manifest names {m.digest}, not {digest}")
    new = await asyncio.to_thread(storeio.put_manifest, store, m)
    return web.json_response({"digest": digest, "new": new}, status=201 if new else 200)


async def _get_chunk(request: web.Request, store: Store) -> web.StreamResponse:
    digest = _digest(request)
    if ZSTD_TYPE in request.headers.get("Accept", ""):
        # A chunk in the page cache is read here: a thread hop costs a lazy reader's
        # miss more than the copy; only one that needs the disk goes to a thread.
        comp = storeio.read_stored_cached(store, digest)
        if comp is None:
            comp = await asyncio.to_thread(storeio.read_stored, store, digest)
        return _ranged(request, comp, ZSTD_TYPE)
    data = await asyncio.to_thread(store.read_chunk, digest)
    return _ranged(request, data, "application/octet-stream")


async def _put_chunk(request: web.Request, store: Store) -> web.StreamResponse:
    digest = _digest(request)
    body = await request.read()
    if request.content_type == ZSTD_TYPE:
        body = await asyncio.to_thread(decompress_chunk, digest, body, "pushed chunk")
    new = await asyncio.to_thread(storeio.put_chunk, store, digest, body)
    return web.json_response({"digest": digest, "new": new}, status=201 if new else 200)


async def _missing(request: web.Request, store: Store) -> web.StreamResponse:
    try:
        want = [check_digest(d) for d in (await request.json())["digests"]]
    except (ValueError, KeyError, TypeError) as exc:
        return _error(400, "bad_request", f"want {{\"digests\": [...]}}: {exc}")
    missing = await asyncio.to_thread(
        lambda: [d for d in want if not storeio.has_chunk(store, d)])
    return web.json_response({"missing": missing})


def make_app(store: Store) -> web.Application:
    """The aiohttp application serving ``store``."""
    app = web.Application(client_max_size=_MAX_BODY)
    app[STORE_KEY] = store
    app.router.add_get("/v1/layers", _handler(_list_layers))
    app.router.add_get("/v1/layers/{digest}", _handler(_get_layer))  # also HEAD
    app.router.add_put("/v1/layers/{digest}", _handler(_put_layer))
    app.router.add_post("/v1/chunks/missing", _handler(_missing))
    app.router.add_get("/v1/chunks/{digest}", _handler(_get_chunk))
    app.router.add_put("/v1/chunks/{digest}", _handler(_put_chunk))
    app.router.add_post("/v1/chunks/{digest}", _handler(_put_chunk))
    return app


class ChunkServer:
    """A running chunk server for ``store`` listening on ``listen`` (``HOST:PORT``, port 0
    picks a free one, or ``unix:/path``). ``await start()`` returns the URL clients use;
    ``await stop()`` closes it. Raises ``OSError`` if the address cannot be bound."""

    def __init__(self, store: Store, listen: str) -> None:
        self.store = store
        self.listen = listen
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        self._runner = web.AppRunner(make_app(self.store), access_log=None)
        await self._runner.setup()
        site: web.BaseSite
        if self.listen.startswith("unix:"):
            path = self.listen[5:]
            if os.path.exists(path):
                os.unlink(path)  # a stale socket of a dead server
            site = web.UnixSite(self._runner, path)
            await site.start()
            self.url = self.listen
        else:
            host, _, port = self.listen.rpartition(":")
            if not host or not port.isdigit():
                await self._runner.cleanup()
                raise ValueError(f"listen address {self.listen!r}: want HOST:PORT or "
                                 "unix:PATH")
            site = web.TCPSite(self._runner, host.strip("[]"), int(port))
            await site.start()
            server = site._server
            assert server is not None
            sock = server.sockets[0]  # type: ignore[attr-defined]
            self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def serve_forever(store: Store, listen: str,
                        ready: Callable[[str], None] | None = None) -> None:
    """Serve ``store`` on ``listen`` until cancelled (``layerfs serve``)."""
    srv = ChunkServer(store, listen)
    url = await srv.start()
    if ready is not None:
        ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await srv.stop()
