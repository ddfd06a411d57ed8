"""Done-when 7: escaping through the files API with ``..``, absolute host paths and symlinks
the workload plants (to /, to a host-looking path, to /proc/1/root, chains of ``..``), for
both reads and writes. Nothing outside the sandbox is read or written; writes into protected
paths fail too (read-only mounts: the daemon writes through the sandbox's own mounts).

The files API refuses these requests before anything is denied by the kernel's confinement,
so they leave no ledger event: the refusal is the API's error (400/404 to the client).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from edged.errors import BadRequest, EdgedError, NotFound
from tests.security.conftest import Node, run, sh, spec

pytestmark = [pytest.mark.root, pytest.mark.mount]


async def _data(b: bytes) -> AsyncIterator[bytes]:
    yield b


def test_files_api_cannot_escape(node: Node, rootfs: Path, tmp_path: Path) -> None:
    b = node.backend
    secret = tmp_path / "host-secret"
    secret.write_text("host only\n")
    host_target = tmp_path / "written-by-sandbox"

    async def get(path: str) -> bytes | None:
        try:
            it = await b.get_file("files", path)
            return b"".join([c async for c in it])
        except EdgedError:
            return None

    async def body() -> None:
        await b.create(spec(rootfs, "files"))
        try:
            _, err, end = await sh(
                b, "files",
                "mkdir -p /work/l && cd /work/l && ln -s / root && ln -s /proc/1/root p1 &&"
                f" ln -s {tmp_path} hostdir && ln -s ../../../../../../../.. up &&"
                f" ln -s {secret} direct && ln -s /proc/self/root/.. self")
            assert end.exit_code == 0, err
            reads = [f"/../../../../..{secret}", str(secret), "/work/l/direct",
                     f"/work/l/root{secret}", f"/work/l/hostdir/{secret.name}",
                     f"/work/l/up{secret}", f"/work/l/p1{secret}", f"/work/l/self{secret}",
                     f"/proc/1/root{secret}", f"/proc/{os.getpid()}/root{secret}"]
            for p in reads:
                got = await get(p)
                assert got is None or b"host only" not in got, p
            writes = [f"/../../../..{host_target}", f"/work/l/root{host_target}",
                      f"/work/l/hostdir/{host_target.name}", f"/work/l/up{host_target}",
                      f"/work/l/p1{host_target}", str(host_target)]
            for p in writes:
                with contextlib.suppress(EdgedError):
                    await b.put_file("files", p, _data(b"pwned\n"))
                assert not host_target.exists(), p
            # a protected binary: refused (read-only mount), the layer's copy intact
            with pytest.raises(EdgedError):
                await b.put_file("files", "/bin/busybox", _data(b"pwned\n"))
            got = await get("/bin/busybox")
            assert got == (rootfs / "bin" / "busybox").read_bytes()
        finally:
            await b.destroy("files")

    run(body)
    assert secret.read_text() == "host only\n"
    assert not host_target.exists()


def test_files_api_stays_off_mounts(node: Node, rootfs: Path) -> None:
    """PUT onto a protected path (a read-only bind mount of itself) is a 400 and leaves the
    mount in place (the daemon renaming from the host's namespace used to replace the file
    under it); /proc, /sys and /dev are out of the files API's reach (400, not 500 or a
    read of another process's memory or environment); protected files stay readable."""
    b = node.backend

    async def body() -> None:
        await b.create(spec(rootfs, "mnts"))
        try:
            for p in ("/etc/passwd", "/usr/bin/attack", "/usr/lib/new", "/dev/shm/x",
                      "/proc/1/environ"):
                with pytest.raises(BadRequest):
                    await b.put_file("mnts", p, _data(b"evil\n"))
            for p in ("/proc/1/mem", "/proc/1/environ", "/proc/self/environ", "/dev/null",
                      "/proc/1/root/etc/passwd"):
                with pytest.raises(BadRequest):
                    await b.get_file("mnts", p)
            # no sysfs unless the task profile asks for one: nothing there to reach
            with pytest.raises(NotFound):
                await b.put_file("mnts", "/sys/kernel/x", _data(b"evil\n"))
            with pytest.raises(NotFound):
                await b.get_file("mnts", "/sys/kernel/osrelease")
            got = b"".join([c async for c in await b.get_file("mnts", "/etc/passwd")])
            assert got.startswith(b"root:x:0:0"), got
            out, _, end = await sh(b, "mnts", "cat /etc/passwd; grep -c ' /etc/passwd ' "
                                   "/proc/self/mounts; echo x >> /etc/passwd")
            assert out.startswith("root:x:0:0") and out.splitlines()[-1] == "1", out
            assert end.exit_code != 0  # still read-only
            # ordinary files still work both ways
            assert await b.put_file("mnts", "/work/ok", _data(b"fine\n")) == 5
            assert b"".join([c async for c in await b.get_file("mnts", "/work/ok")]) == b"fine\n"
        finally:
            await b.destroy("mnts")

    run(body)
