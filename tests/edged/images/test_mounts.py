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


def test_the_last_reference_lingers(tmp_path) -> None:
    """The one owner of a mounted layer's lifetime: the last release keeps the layer
    mounted ``linger_s``, a create meanwhile reuses it (no second mount), and a release
    restarts the wait; flush drops the lingering references at once."""
    mounts, ops = fake_layers(tmp_path, {digest(1), digest(2)})
    mounts.linger_s = 0.2

    async def main() -> None:
        await mounts.acquire_all([digest(1), digest(2)])
        await mounts.release(digest(1))
        await mounts.release(digest(2))
        assert ops.umount_calls == 0 and mounts.lingering() == [digest(1), digest(2)]
        await mounts.acquire(digest(1))  # reused
        assert ops.mount_calls == 2
        await asyncio.sleep(0.35)  # digest(2)'s linger ran out; digest(1) is held
        assert ops.umount_calls == 1 and list(ops.mounted) == [str(mounts.mountpoint(digest(1)))]
        await mounts.release(digest(1))
        assert mounts.lingering() == [digest(1)] and ops.umount_calls == 1
        await mounts.flush()
        assert ops.mounted == {} and mounts.refs() == {} and mounts.lingering() == []

    asyncio.run(main())
