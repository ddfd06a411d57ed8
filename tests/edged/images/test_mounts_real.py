"""Real layer mounts: a layer built by layerfs into a real store, exported to the node cache,
file-backed EROFS mounted once, refcounted and unmounted (root)."""

from __future__ import annotations

import asyncio
import os

import pytest

from edged.images.mounts import LayerMounts


@pytest.mark.root
@pytest.mark.mount
def test_store_layer_mounted_once(tmp_path) -> None:
    from layerfs.build import build_layer
    from layerfs.store import Store

    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("from a layer\n")
    store = Store(tmp_path / "store")
    digest = build_layer(str(src), kind="base", store=store).digest
    mounts = LayerMounts.for_layerfs(str(tmp_path / "store"), tmp_path / "cache",
                                     tmp_path / "mnt")
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
    assert (tmp_path / "cache" / (digest[7:] + ".erofs")).stat().st_size > 0
