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

from edged.errors import EdgedError
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
