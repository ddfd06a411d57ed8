"""The spawner's rootfs made the way kernels before 6.15 need (the 6.1 LTS of production nodes
and of scripts/node-vm.sh: no clones of a detached mount, no overlayfs ``lowerdir+`` fd), here
forced with ``EDGED_SPAWNER_STAGED=1`` on any kernel: the layers in order, /dev and /dev/shm
from the scratch tmpfs, the grader's exec, nothing of the staging left on the host."""

from __future__ import annotations

import asyncio
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
