"""Client of a chunk server (``layerfs serve``) over HTTP/1.1, on TCP or a unix socket.

Wire protocol (the server is :mod:`layerfs.remote.server`)::

    GET|HEAD /v1/layers/{digest}     manifest (canonical JSON)         200 | 404
    PUT      /v1/layers/{digest}     store a manifest                  201 new | 200 | 409
    GET      /v1/layers              {"layers": [digest, ...]}
    GET|HEAD /v1/chunks/{digest}     chunk bytes; Range supported      200 | 206 | 404 | 416
             (Accept: application/zstd: the stored zstd frame instead)
    PUT      /v1/chunks/{digest}     store a chunk (raw or zstd body)  201 new | 200 | 400
    POST     /v1/chunks/missing      {"digests": [...]} -> {"missing": [...]}

Errors are ``{"error": {"code": ..., "message": ...}}`` with the HTTP status.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import aiohttp
import zstandard

from layerfs.errors import CorruptError, NotFoundError
from layerfs.manifest import Manifest, check_digest
from layerfs.remote.base import (
    PushRejectedError,
    Remote,
    RemoteError,
    decompress_chunk,
    verify_chunk,
)

ZSTD_TYPE = "application/zstd"


class HttpRemote(Remote):
    """A chunk server at ``url`` (``http://HOST:PORT`` or ``unix:/path``).

    ``timeout`` bounds each request in seconds (connect plus transfer). Chunks are
    fetched zstd-compressed and verified after decompressing. Use as ``async with``.
    """

    def __init__(self, url: str, *, timeout: float = 30.0, connections: int = 16) -> None:
        self.url = url
        if url.startswith("unix:"):
            self._base = "http://localhost"
            self._connector: aiohttp.BaseConnector | None = None
            self._unix: str | None = url[5:]
        else:
            self._base = url.rstrip("/")
            self._unix = None
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            conn: aiohttp.BaseConnector
            if self._unix is not None:
                conn = aiohttp.UnixConnector(path=self._unix, limit=self._connections)
            else:
                conn = aiohttp.TCPConnector(limit=self._connections)
            self._session = aiohttp.ClientSession(connector=conn, timeout=self._timeout,
                                                  auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, what: str, **kw: Any) -> tuple[
            int, dict[str, str], bytes]:
        try:
            async with self._sess().request(method, self._base + path, **kw) as r:
                body = await r.read()
                return r.status, dict(r.headers), body
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise RemoteError(f"remote {self.url}: {what}: {type(exc).__name__}: "
                              f"{exc}") from None

    def _fail(self, status: int, body: bytes, what: str) -> RemoteError:
        try:
            msg = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = body[:200].decode("utf-8", "replace")
        return RemoteError(f"remote {self.url}: {what}: HTTP {status}: {msg}")

    async def manifest(self, digest: str) -> Manifest:
        check_digest(digest)
        what = f"layer {digest}"
        status, _, body = await self._request("GET", f"/v1/layers/{digest}", what)
        if status == 404:
            raise NotFoundError(f"remote {self.url}: layer {digest} not found")
        if status != 200:
            raise self._fail(status, body, what)
        m = Manifest.from_json(body, where=f"remote {self.url}: manifest {digest}")
        if m.digest != digest:
            raise CorruptError(f"remote {self.url}: manifest for {digest} names {m.digest}")
        return m

    async def has_layer(self, digest: str) -> bool:
        check_digest(digest)
        what = f"layer {digest}"
        status, _, body = await self._request("HEAD", f"/v1/layers/{digest}", what)
        if status in (200, 404):
            return status == 200
        raise self._fail(status, body, what)

    async def layers(self) -> list[str]:
        """Digests of every layer the server holds."""
        status, _, body = await self._request("GET", "/v1/layers", "list layers")
        if status != 200:
            raise self._fail(status, body, "list layers")
        return list(json.loads(body)["layers"])

    async def chunk(self, digest: str, *, length: int | None = None) -> bytes:
        check_digest(digest)
        what = f"chunk {digest}"
        status, headers, body = await self._request(
            "GET", f"/v1/chunks/{digest}", what, headers={"Accept": ZSTD_TYPE})
        if status == 404:
            raise NotFoundError(f"remote {self.url}: chunk {digest} not found")
        if status != 200:
            raise self._fail(status, body, what)
        where = f"remote {self.url}"
        if headers.get("Content-Type", "").startswith(ZSTD_TYPE):
            body = decompress_chunk(digest, body, where)
        return verify_chunk(digest, body, where, length=length)

    async def chunk_range(self, digest: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of chunk ``digest``, uncompressed. A
        part of a chunk cannot be verified on its own: callers that need integrity fetch
        whole chunks with :meth:`chunk`."""
        check_digest(digest)
        what = f"chunk {digest} bytes {start}-{end}"
        status, _, body = await self._request(
            "GET", f"/v1/chunks/{digest}", what, headers={"Range": f"bytes={start}-{end - 1}"})
        if status == 404:
            raise NotFoundError(f"remote {self.url}: chunk {digest} not found")
        if status not in (200, 206):
            raise self._fail(status, body, what)
        return body if status == 206 else body[start:end]

    async def missing_chunks(self, digests: Iterable[str]) -> list[str]:
        want = [check_digest(d) for d in digests]
        out: list[str] = []
        for i in range(0, len(want), 4096):  # bounded request bodies
            batch = want[i:i + 4096]
            status, _, body = await self._request(
                "POST", "/v1/chunks/missing", "missing chunks", json={"digests": batch})
            if status != 200:
                raise self._fail(status, body, "missing chunks")
            out.extend(json.loads(body)["missing"])
        return out

    async def put_chunk(self, digest: str, data: bytes) -> bool:
        check_digest(digest)
        what = f"push chunk {digest}"
        comp = zstandard.ZstdCompressor(level=3).compress(data)
        status, _, body = await self._request(
            "PUT", f"/v1/chunks/{digest}", what, data=comp,
            headers={"Content-Type": ZSTD_TYPE})
        if status in (200, 201):
            return status == 201
        if status == 400:
            raise PushRejectedError(f"remote {self.url}: {what}: "
                                    f"{self._fail(status, body, what)}")
        raise self._fail(status, body, what)

    async def put_manifest(self, manifest: Manifest) -> bool:
        what = f"push layer {manifest.digest}"
        status, _, body = await self._request(
            "PUT", f"/v1/layers/{manifest.digest}", what, data=manifest.to_json(),
            headers={"Content-Type": "application/json"})
        if status in (200, 201):
            return status == 201
        if status == 409:
            try:
                missing = json.loads(body)["error"]["missing"]
            except (ValueError, KeyError, TypeError):
                missing = []
            raise PushRejectedError(f"remote {self.url}: {what}: chunks missing", missing)
        if status == 400:
            raise PushRejectedError(str(self._fail(status, body, what)))
        raise self._fail(status, body, what)
