"""Node layer mounts: once per node, refcounted, nothing left after a failure."""

from __future__ import annotations

import asyncio

import pytest

from edged.errors import BackendError, NotFound
from tests.edged.fakes import digest, fake_layers


def test_concurrent_acquires_mount_once(tmp_path) -> None:
    mounts, ops = fake_layers(tmp_path, {digest(1)})

    async def main() -> None:
        paths = await asyncio.gather(*(mounts.acquire(digest(1)) for _ in range(20)))
        assert len(set(paths)) == 1 and ops.mount_calls == 1
        assert mounts.refs() == {digest(1): 20}
        for _ in range(19):
            await mounts.release(digest(1))
        assert ops.umount_calls == 0
        await mounts.release(digest(1))
        assert ops.umount_calls == 1 and ops.mounted == {} and mounts.refs() == {}
        await mounts.acquire(digest(1))
        assert ops.mount_calls == 2
        await mounts.close()
        assert ops.mounted == {} and mounts.refs() == {}

    asyncio.run(main())
    assert (tmp_path / "cache" / (digest(1)[7:] + ".erofs")).read_bytes() == digest(1).encode()


def test_acquire_all_rolls_back(tmp_path) -> None:
    mounts, ops = fake_layers(tmp_path, {digest(1), digest(2)})

    async def main() -> None:
        with pytest.raises(NotFound, match="not in the layer store"):
            await mounts.acquire_all([digest(1), digest(2), digest(3)])
        assert ops.mounted == {} and mounts.refs() == {}

        def broken(img: str, mp: str) -> None:
            raise OSError(19, "No such device")

        mounts.ops.mount = broken
        with pytest.raises(BackendError, match="cannot mount"):
            await mounts.acquire(digest(1))
        assert mounts.refs() == {} and not (tmp_path / "mnt" / digest(1)[7:]).exists()

    asyncio.run(main())
