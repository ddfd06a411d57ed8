"""layerfs.mount helpers that the EROFS and overlay tests do not cover: the size-limited
tmpfs that holds a sandbox's upper and work directories; EROFS mounted through a loop device
where the kernel has no file-backed mounts (6.1 LTS) or refuses the file (on tmpfs or
overlayfs), the loop device gone with the mount."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerfs import mount
from layerfs.mount import mount_erofs, mount_tmpfs, umount
from layerfs.sources.directory import load_directory
from layerfs.writer import write_image


def test_tmpfs_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        mount_tmpfs(tmp_path, size=0)
    with pytest.raises(ValueError, match="permission bits"):
        mount_tmpfs(tmp_path, size=1 << 20, mode=0o17777)


@pytest.mark.root
@pytest.mark.mount
def test_tmpfs_size_limit_and_mode(tmp_path: Path) -> None:
    mp = tmp_path / "scratch"
    mp.mkdir()
    mount_tmpfs(mp, size=1 << 20, mode=0o710)
    try:
        assert os.stat(mp).st_mode & 0o7777 == 0o710
        fd = os.open(mp / "big", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError) as ei:
                for _ in range(512):
                    os.write(fd, b"x" * 4096)
            assert ei.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
    finally:
        umount(mp)
    assert not os.path.ismount(mp)
    with pytest.raises(OSError) as ei2:
        mount_tmpfs(tmp_path / "absent", size=1 << 20)
    assert ei2.value.errno == errno.ENOENT


def _source(mp: Path) -> str:
    """The mount source of ``mp`` (mountinfo's field after the ``-`` separator's fstype)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mp):
            return fields[fields.index("-") + 2]
    raise AssertionError(f"{mp} is not mounted")


def _loops_backed_by(path: Path) -> list[str]:
    """Loop devices whose backing file is ``path``."""
    out = []
    for d in Path("/sys/block").glob("loop*"):
        try:
            if (d / "loop" / "backing_file").read_text().strip() == str(path):
                out.append(d.name)
        except OSError:
            pass
    return out


@pytest.fixture
def image_dirs(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """An EROFS image (one file, ``hello``) on a disk filesystem (/var/tmp) and a copy on
    tmpfs (/dev/shm), and a mountpoint."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello").write_text("from the layer\n")
    disk = Path(tempfile.mkdtemp(prefix="layerfs-test-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="layerfs-test-", dir="/dev/shm"))
    write_image(load_directory(src), disk / "l.erofs")
    (shm / "l.erofs").write_bytes((disk / "l.erofs").read_bytes())
    (tmp_path / "mnt").mkdir()
    yield {"disk": disk / "l.erofs", "shm": shm / "l.erofs", "mnt": tmp_path / "mnt"}
    for d in (disk, shm):
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


@contextlib.contextmanager
def _mounted(img: Path, mp: Path, *, lazy: bool = False) -> Iterator[str]:
    """``img`` mounted at ``mp`` (its file read through the mount); yields the mount's
    source. After the unmount no loop device is left backed by ``img``."""
    mount_erofs(img, mp)
    try:
        assert (mp / "hello").read_text() == "from the layer\n"
        yield _source(mp)
    finally:
        umount(mp, lazy=lazy)
    assert not _loops_backed_by(img)


@pytest.mark.root
@pytest.mark.mount
def test_erofs_mounts_file_backed_where_the_probe_says(image_dirs: dict[str, Path]) -> None:
    img, mp = image_dirs["disk"], image_dirs["mnt"]
    with _mounted(img, mp) as source:
        if mount.erofs_file_backed():
            assert source == str(img)
            assert not _loops_backed_by(img)
        else:  # e.g. the 6.1 LTS kernel of the node VM (scripts/node-vm.sh)
            assert source.startswith("/dev/loop"), source


@pytest.mark.root
@pytest.mark.mount
def test_without_file_backed_mounts_a_loop_device_is_used_and_goes_with_the_mount(
        image_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    img, mp = image_dirs["disk"], image_dirs["mnt"]
    monkeypatch.setattr(mount, "_file_backed", False)  # as on a kernel before 6.12
    with _mounted(img, mp, lazy=True) as dev:  # a lazy unmount too lets the kernel detach it
        assert dev.startswith("/dev/loop"), dev
        name = dev.removeprefix("/dev/")
        assert _loops_backed_by(img) == [name]
        assert Path(f"/sys/block/{name}/ro").read_text().strip() == "1"
        assert Path(f"/sys/block/{name}/loop/autoclear").read_text().strip() == "1"
    # a mount that fails (no EROFS superblock) leaves no loop device either
    bad = img.with_name("zeros.erofs")
    bad.write_bytes(bytes(8192))
    with pytest.raises(OSError) as ei:
        mount_erofs(bad, mp)
    assert ei.value.errno in (errno.EINVAL, errno.EUCLEAN), ei.value
    assert "loop" in str(ei.value)
    assert not _loops_backed_by(bad)


@pytest.mark.root
@pytest.mark.mount
def test_an_image_on_tmpfs_mounts_through_a_loop_device(image_dirs: dict[str, Path]) -> None:
    """A file on tmpfs is refused file-backed (ENOTBLK, also on 6.18): it was an error."""
    img, mp = image_dirs["shm"], image_dirs["mnt"]
    with _mounted(img, mp) as source:
        assert source.startswith("/dev/loop"), source
