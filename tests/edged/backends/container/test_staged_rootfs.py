"""The spawner's rootfs made the way kernels before 6.15 need (the 6.1 LTS of production nodes
and of scripts/node-vm.sh: no clones of a detached mount, no overlayfs ``lowerdir+`` fd), here
forced with ``EDGED_SPAWNER_STAGED=1`` on any kernel: the layers in order, /dev and /dev/shm
from the scratch tmpfs, the grader's exec, nothing of the staging left on the host."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from edged.backends.base import ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend
from tests.edged.execs import collect

pytestmark = [pytest.mark.root, pytest.mark.mount]

ENV = {"PATH": "/bin"}


def test_a_sandbox_on_a_staged_rootfs(backend: ContainerBackend, busybox_tree: Path,
                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGED_SPAWNER_STAGED", "1")
    top = tmp_path / "top"
    (top / "etc").mkdir(parents=True)
    (top / "etc" / "layer").write_text("top\n")
    spec = SandboxSpec(id="staged", lowers=(str(busybox_tree), str(top)),
                       resources=Resources(disk_bytes=8 << 20), env=ENV, hostname="staged")

    async def sh(script: str, trusted: bool = False) -> tuple[str, int | None]:
        h = await backend.exec("staged", ExecSpec(argv=("sh", "-c", script), env=ENV,
                                                  trusted=trusted))
        out, _err, end = await collect(h)
        return out.decode(), end.exit_code

    async def body() -> None:
        await backend.create(spec)
        try:
            out, rc = await sh("grep ' / overlay ' /proc/mounts; cat /etc/layer; "
                               "echo shm > /dev/shm/x && cat /dev/shm/x; "
                               "echo up > /tmp/y && cat /tmp/y; "
                               "head -c 3 /dev/zero | wc -c; ls /dev")
            assert rc == 0, out
            lines = out.splitlines()
            # the overlay from the staged paths, top layer first
            assert "lowerdir=/tmp/l1:/tmp/l0" in lines[0], lines[0]
            assert lines[1:5] == ["top", "shm", "up", "3"], out
            assert {"null", "zero", "shm", "pts"} <= set(" ".join(lines[5:]).split())
            # /dev/shm and the upper share the scratch tmpfs's limit (8 MiB)
            out, rc = await sh("dd if=/dev/zero of=/dev/shm/big bs=1M count=16 2>/dev/null;"
                               " echo $?; rm -f /dev/shm/big")
            assert out.split()[0] != "0", out
            out, rc = await sh("cat /etc/layer; id -u", trusted=True)
            assert (out, rc) == ("top\n0\n", 0)
        finally:
            await backend.destroy("staged")
        assert "edged-stage" not in Path("/proc/self/mountinfo").read_text()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_staged_sandbox_on_a_shared_scratch_filesystem_leaves_it_clean(
        state_dir: Path, busybox_tree: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's scratch filesystem shared, as every mount of a systemd host is (the node
    VM: XFS scratch, 6.1): the staged rootfs's detached clones of it were no part of the
    namespace made private, so they stayed in its peer group, and the sandbox's mounts on
    /dev (its device binds, pts) appeared on the host's ``<scratch>/<id>/dev``: the upper
    could not be removed at destroy, nor the filesystem unmounted. Now nothing of the
    sandbox is mounted on the host, and its directory goes with it."""
    monkeypatch.setenv("EDGED_SPAWNER_STAGED", "1")
    fs = tmp_path / "scratchfs"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "i17-scratch", str(fs)],
                   check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(fs)], check=True)
        backend = ContainerBackend(state_dir, scratch_dir=fs)
        spec = SandboxSpec(id="shared", lowers=(str(busybox_tree),),
                           resources=Resources(disk_bytes=8 << 20), env=ENV,
                           hostname="shared")

        async def body() -> list[str]:
            await backend.create(spec)
            try:
                h = await backend.exec("shared", ExecSpec(argv=("ls", "/dev"), env=ENV))
                out, _err, end = await collect(h)
                assert end.exit_code == 0 and b"null" in out, out
                return [m.split()[1] for m in Path("/proc/self/mounts").read_text().splitlines()
                        if m.split()[1].startswith(str(fs) + "/")]
            finally:
                await backend.destroy("shared")

        seen = asyncio.run(asyncio.wait_for(body(), 120))
        assert seen == [], f"the sandbox's mounts appeared on the host: {seen}"
        assert not (fs / "shared").exists()
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=True)
