"""Real layer mounts: a layer built by layerfs into a real store, served lazily by the node's
lazy FUSE server (the local store as a file: remote), file-backed EROFS mounted once,
refcounted and unmounted; the lazy server's metrics are exposed (root)."""

from __future__ import annotations

import asyncio
import os

import pytest

from edged.images.mounts import LayerMounts


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.fuse
def test_store_layer_mounted_once_lazily(tmp_path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from layerfs.build import build_layer
    from layerfs.store import Store

    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("from a layer\n")
    (src / "big").write_bytes(os.urandom(4 << 20))
    store = Store(tmp_path / "store", chunk_size=256 << 10)
    digest = build_layer(str(src), kind="base", store=store).digest
    cache = tmp_path / "cache"
    mounts = LayerMounts.for_layerfs(str(tmp_path / "store"), cache, tmp_path / "mnt")
    try:
        assert mounts.ops.has(digest) and not mounts.ops.has("sha256:" + "0" * 64)

        async def main() -> None:
            mp = await mounts.acquire(digest)
            try:
                assert await mounts.acquire(digest) == mp
                assert os.path.ismount(mp)
                with open(os.path.join(mp, "etc", "hello")) as f:
                    assert f.read() == "from a layer\n"
                await mounts.release(digest)
                assert os.path.ismount(mp)
            finally:
                await mounts.release(digest)
            assert not os.path.ismount(mp) and not os.path.exists(mp)

        asyncio.run(main())
        reg = CollectorRegistry()
        reg.register(mounts.ops.collector)
        text = generate_latest(reg).decode()
        assert "layerfs_lazy_up 1.0" in text
        fetched = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f'layerfs_lazy_fraction_fetched{{layer="{digest}"}}')]
        assert fetched and 0 < fetched[0] < 0.5  # hello was read, big was not
    finally:
        asyncio.run(mounts.close())
    with open("/proc/mounts") as f:
        assert str(cache / "fuse") not in f.read()
    assert not (cache / "supervisor.pid").exists()
