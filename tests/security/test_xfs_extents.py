"""Done-when 2: extent-moving ioctls (XFS_IOC_SWAPEXT, FICLONE, FICLONERANGE, FIDEDUPERANGE)
between a protected file and an agent's file on a real XFS filesystem, plain and with the
high 32 bits of the request number set: all denied by seccomp (EPERM, recorded), and XFS
passes ``xfs_repair -n`` afterwards.

Set-up: a loop-mounted XFS image (reflink on) holds both the sandbox's lower (the rootfs
with the protected /bin/busybox) and its upper (the backend's ``scratch_dir``), so the
protected file and the agent's /tmp file really are on the same XFS.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.conftest import (
    Node,
    assert_all_failed,
    denied,
    execv,
    make_rootfs,
    results,
    run,
    sh,
    spec,
)

pytestmark = [pytest.mark.root, pytest.mark.mount]

IOCTLS = {"FICLONE": 0x40049409, "FICLONERANGE": 0x4020940D, "FIDEDUPERANGE": 0xC0189436,
          "XFS_IOC_SWAPEXT": 0xC0C0586D}


@pytest.fixture(params=["noquota"])
def xfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path]]:
    """(mountpoint, image) of a fresh 300 MiB XFS (the mkfs.xfs minimum), unmounted after;
    mounted with project quotas when parametrized ``prjquota``."""
    if not shutil.which("mkfs.xfs"):
        pytest.skip("needs xfsprogs")
    image = tmp_path / "xfs.img"
    with open(image, "wb") as f:
        f.truncate(300 << 20)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    mnt = tmp_path / "xfs"
    mnt.mkdir()
    # mount(8) makes an autoclear loop device: it goes with the unmount
    opts = "loop,prjquota" if request.param == "prjquota" else "loop"
    r = subprocess.run(["mount", "-o", opts, str(image), str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0 and request.param == "prjquota":
        pytest.skip("XFS project quotas: this kernel has no XFS quota support")
    assert r.returncode == 0, r.stderr
    try:
        yield mnt, image
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_extent_ioctls_denied_on_xfs(node_factory, attack_bin: Path,
                                     xfs: tuple[Path, Path]) -> None:
    mnt, image = xfs
    lower = make_rootfs(mnt / "lower", attack_bin)
    (mnt / "scratch").mkdir()
    node: Node = node_factory(scratch_dir=mnt / "scratch")
    b, ledger = node.backend, node.ledger
    before = hashlib.sha256((lower / "bin" / "busybox").read_bytes()).hexdigest()

    async def body() -> None:
        await b.create(spec(lower, "xfs1"))
        try:
            out, err, end = await sh(b, "xfs1", "head -c 65536 /dev/urandom > /tmp/mine")
            assert end.exit_code == 0, err
            # the agent's file is in the upper, on the same XFS as the protected lower file
            assert (mnt / "scratch" / "xfs1" / "upper" / "tmp" / "mine").stat().st_size == 65536
            out, err, end = await execv(b, "xfs1",
                                        ("/usr/bin/attack", "ioctl", "/bin/busybox", "/tmp/mine"))
            assert end.exit_code == 0, err
            res = results(out)
            expected = set(IOCTLS) | {f"{k}_highbits" for k in IOCTLS}
            assert_all_failed(res, expected)
            assert {res[k] for k in expected} == {"EPERM"}, res
        finally:
            await b.destroy("xfs1")

    run(body)
    assert not (mnt / "scratch" / "xfs1").exists()  # teardown removed the upper
    ev = [e for e in denied(ledger, "xfs1") if e.syscall == "ioctl"]
    seen = sorted(int(e.detail["ioctl"], 16) for e in ev)
    assert seen == sorted(list(IOCTLS.values()) * 2), seen  # plain and high-bit variants
    highs = {int(e.detail["args"][1], 16) >> 32 for e in ev}
    assert highs == {0, 0xDEAD}
    after = hashlib.sha256((lower / "bin" / "busybox").read_bytes()).hexdigest()
    assert after == before
    subprocess.run(["umount", str(mnt)], check=True)
    try:
        fsck = subprocess.run(["xfs_repair", "-n", str(image)], capture_output=True, text=True)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    finally:
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)


@pytest.mark.parametrize("xfs", ["prjquota"], indirect=True)
def test_disk_fill_on_xfs_scratch_is_per_sandbox(node_factory, attack_bin: Path,
                                                 xfs: tuple[Path, Path]) -> None:
    """Uppers on the node's XFS scratch: each sandbox's project quota is its disk limit; a
    full one is ENOSPC (and ``disk_full``) for that sandbox only."""
    mnt, image = xfs
    lower = make_rootfs(mnt / "lower", attack_bin)
    (mnt / "scratch").mkdir()
    node: Node = node_factory(scratch_dir=mnt / "scratch")
    b, ledger = node.backend, node.ledger

    async def body() -> None:
        await b.create(spec(lower, "full", disk_bytes=16 << 20))
        await b.create(spec(lower, "other", disk_bytes=64 << 20))
        try:
            _, err, end = await sh(b, "full", "dd if=/dev/zero of=/tmp/fill bs=1M count=64")
            assert end.exit_code != 0 and "No space left" in err, err
            out, _, _ = await sh(b, "full", "stat -c %s /tmp/fill")
            assert int(out) <= 16 << 20
            _, err, end = await sh(b, "other", "dd if=/dev/zero of=/tmp/fill bs=1M count=32")
            assert end.exit_code == 0, err
        finally:
            await b.destroy("full")
            await b.destroy("other")

    run(body)
    assert "disk_full" in {e.kind for e in ledger.events("full")}
    assert not ledger.known("other")
    subprocess.run(["umount", str(mnt)], check=True)
    try:
        fsck = subprocess.run(["xfs_repair", "-n", str(image)], capture_output=True, text=True)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    finally:
        subprocess.run(["mount", "-o", "loop,prjquota", str(image), str(mnt)], check=True)
