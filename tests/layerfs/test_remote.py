"""The chunk server, its HTTP client, the shared-directory remote and push."""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import zstandard

from layerfs.errors import CorruptError, NotFoundError
from layerfs.remote import PushRejectedError, open_remote, push
from layerfs.remote.base import Remote
from layerfs.remote.server import ChunkServer
from layerfs.store import Store

CHUNK = 64 << 10


def _image(path: pathlib.Path, size: int, seed: int = 1) -> pathlib.Path:
    rnd = hashlib.sha256(str(seed).encode()).digest()
    out = bytearray()
    while len(out) < size:
        rnd = hashlib.sha256(rnd).digest()
        out += rnd * 64
    del out[size:]
    # a run of zeros: chunks that repeat within the layer (dedup on push)
    out[CHUNK:3 * CHUNK] = bytes(2 * CHUNK)
    path.write_bytes(out)
    return path


@pytest.fixture
def src_store(tmp_path: pathlib.Path) -> tuple[Store, str, bytes]:
    store = Store(tmp_path / "src", chunk_size=CHUNK)
    img = _image(tmp_path / "a.img", 10 * CHUNK + 1234)
    m = store.add_image(img, kind="base", source="test")
    return store, m.digest, img.read_bytes()


def _serve(store: Store, listen: str,
           body: Callable[[str], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        srv = ChunkServer(store, listen)
        url = await srv.start()
        try:
            return await body(url)
        finally:
            await srv.stop()
    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_push_then_fetch_round_trip(src_store: tuple[Store, str, bytes], tmp_path: pathlib.Path,
                                    kind: str) -> None:
    store, digest, image = src_store
    dst = Store(tmp_path / "dst")
    listen = "127.0.0.1:0" if kind == "tcp" else f"unix:{tmp_path}/s.sock"

    async def body(url: str) -> None:
        async with open_remote(url) as r:
            assert not await r.has_layer(digest)
            res = await push(store, digest, r)
            # 11 chunks, two of them the same zeros: 10 distinct, all new
            assert (res.sent_chunks, res.skipped_chunks, res.manifest_new) == (10, 0, True)
            again = await push(store, digest, r)
            assert (again.sent_chunks, again.manifest_new) == (0, False)
            m = await r.manifest(digest)
            assert m == store.manifest(digest)
            got = b"".join([await r.chunk(c.digest, length=m.chunk_length(i))
                            for i, c in enumerate(m.chunks)])
            assert got == image
    _serve(dst, listen, body)
    assert dst.verify(digest).ok


def test_push_resumes_sending_only_missing(src_store: tuple[Store, str, bytes],
                                           tmp_path: pathlib.Path) -> None:
    store, digest, _ = src_store
    dst = Store(tmp_path / "dst")
    m = store.manifest(digest)

    async def body(url: str) -> None:
        async with open_remote(url) as r:
            # an earlier push died after four chunks (three distinct: 1 and 2 are zeros)
            for c in m.chunks[:4]:
                await r.put_chunk(c.digest, store.read_chunk(c.digest))
            with pytest.raises(PushRejectedError) as ei:
                await r.put_manifest(m)  # not complete: refused, naming what is missing
            assert len(ei.value.missing) == 7
            assert not await r.has_layer(digest)
            res = await push(store, digest, r)
            assert (res.sent_chunks, res.skipped_chunks) == (7, 3)
    _serve(dst, "127.0.0.1:0", body)
    assert dst.verify(digest).ok


def test_server_verifies_pushed_chunks(tmp_path: pathlib.Path) -> None:
    dst = Store(tmp_path / "dst")
    good = b"x" * 5000
    digest = "sha256:" + hashlib.sha256(good).hexdigest()

    async def body(url: str) -> None:
        async with open_remote(url) as r:
            with pytest.raises(PushRejectedError, match="does not match"):
                await r.put_chunk(digest, b"y" * 5000)
            assert await r.missing_chunks([digest]) == [digest]
            assert await r.put_chunk(digest, good) is True
            assert await r.put_chunk(digest, good) is False
            assert await r.missing_chunks([digest]) == []
    _serve(dst, "127.0.0.1:0", body)


def test_ranges_head_and_errors(src_store: tuple[Store, str, bytes]) -> None:
    store, digest, image = src_store
    m = store.manifest(digest)
    c0 = m.chunks[0].digest

    async def body(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/chunks/{c0}", headers={"Range": "bytes=10-19"}) as r:
                assert r.status == 206
                assert r.headers["Content-Range"] == f"bytes 10-19/{CHUNK}"
                assert await r.read() == image[10:20]
            async with s.get(f"{url}/v1/chunks/{c0}", headers={"Range": "bytes=-5"}) as r:
                assert r.status == 206 and await r.read() == image[CHUNK - 5:CHUNK]
            async with s.get(f"{url}/v1/chunks/{c0}",
                             headers={"Range": f"bytes={CHUNK}-"}) as r:
                assert r.status == 416
            async with s.head(f"{url}/v1/chunks/{c0}") as r:
                assert r.status == 200 and int(r.headers["Content-Length"]) == CHUNK
            async with s.head(f"{url}/v1/layers/{digest}") as r:
                assert r.status == 200
            async with s.get(f"{url}/v1/layers/sha256:{'0' * 64}") as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "not_found"
            async with s.get(f"{url}/v1/chunks/nonsense") as r:
                assert r.status == 400
        async with open_remote(url) as rem:
            with pytest.raises(NotFoundError):
                await rem.manifest(f"sha256:{'1' * 64}")
    _serve(store, "127.0.0.1:0", body)


def _corrupt(store: Store, digest: str) -> None:
    # a valid zstd frame of the wrong bytes: only a digest check can catch it
    path = os.path.join(store.root, "chunks", digest[7:9], digest[7:])
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(b"evil" * 1000))


def test_corrupt_chunk_is_never_served(src_store: tuple[Store, str, bytes]) -> None:
    store, digest, _ = src_store
    c = store.manifest(digest).chunks[5].digest
    _corrupt(store, c)

    async def body(url: str) -> None:
        async with open_remote(url) as r:
            with pytest.raises(CorruptError, match="does not match"):
                await r.chunk(c)  # the zstd path: the client checks
        async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/chunks/{c}") as resp:
            assert resp.status == 500  # the raw path: the server checks
    _serve(store, "127.0.0.1:0", body)


def test_directory_remote(src_store: tuple[Store, str, bytes], tmp_path: pathlib.Path) -> None:
    store, digest, image = src_store

    async def body() -> None:
        r: Remote
        async with open_remote(str(tmp_path / "shared"), create=True) as r:
            res = await push(store, digest, r)
            assert res.sent_chunks == 10
            m = await r.manifest(digest)
            assert await r.chunk(m.chunks[0].digest) == image[:CHUNK]
        async with open_remote(f"file:{store.root}") as r:
            c = store.manifest(digest).chunks[3].digest
            _corrupt(store, c)
            with pytest.raises(CorruptError):
                await r.chunk(c)
    asyncio.run(body())


def test_open_remote_rejects_unknown_schemes() -> None:
    with pytest.raises(ValueError, match="want http"):
        open_remote("ftp://x")
