"""The upper layer is RAM (a tmpfs): what it holds is the sandbox's memory, charged to its
memory cgroup and seen by its limit, ``stats()`` and admission, files written through the
API included (issue 9, item 6: a 1 GiB upload had put 1 GiB into the daemon's cgroup while
``stats()`` said 0.5 MB); and an exec's end keeps to its documented fields."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from edged.backends.base import ExecSpec
from edged.backends.container import ContainerBackend
from edged.errors import BadRequest
from tests.edged.backends.container.test_container import chunks, read_file, run, sh, spec

pytestmark = [pytest.mark.root, pytest.mark.mount]

MiB = 1 << 20


def _own_shmem() -> int:
    """tmpfs bytes charged to this process's own memory cgroup (not its children: the
    sandboxes' cgroups are beneath it)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _h, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            break
        if ctrls == "":
            d = Path("/sys/fs/cgroup") / path.lstrip("/")
    stat = dict(x.split() for x in (d / "memory.stat").read_text().splitlines())
    return int(stat["shmem"])


async def _mib(n: int) -> AsyncIterator[bytes]:
    block = b"u" * MiB
    for _ in range(n):
        yield block


def test_an_upload_is_charged_to_the_sandbox(backend: ContainerBackend,
                                             busybox_tree: Path) -> None:
    async def body() -> None:
        await backend.create(spec((str(busybox_tree),)))
        try:
            before = (await backend.memory("sb1")).resident_bytes
            own = _own_shmem()
            assert await backend.put_file("sb1", "/tmp/up", _mib(96)) == 96 * MiB
            after = await backend.memory("sb1")
            # the upload is the sandbox's (shmem); what else it held may have been
            # reclaimed meanwhile on a busy host (the sandbox's page cache: ~1 MiB)
            assert after.shmem_bytes >= 96 * MiB
            assert after.resident_bytes >= after.shmem_bytes
            assert after.resident_bytes - before >= 96 * MiB - 4 * MiB
            assert _own_shmem() - own < 8 * MiB, "the daemon's cgroup holds the upload"
            st = await backend.stats("sb1")
            assert st["memory_bytes"] >= 96 * MiB and 96 * MiB <= st["upper_bytes"] < 128 * MiB
            out, _, end = await sh(backend, "sb1", "wc -c < /tmp/up; ls -l /tmp/up")
            assert out.split()[0] == b"100663296" and end.exit_code == 0
            # the daemon's copy helper is gone: the sandbox holds only its own processes
            assert await read_file(backend, "sb1", "/tmp/up") == b"u" * (96 * MiB)
            # removing the file gives the memory back
            await sh(backend, "sb1", "rm /tmp/up")
            assert (await backend.stats("sb1"))["upper_bytes"] < 8 * MiB
        finally:
            await backend.destroy("sb1")

    run(body)


def test_an_upload_over_the_memory_limit_is_refused_and_kills_nothing(
        backend: ContainerBackend, busybox_tree: Path) -> None:
    async def body() -> None:
        await backend.create(spec((str(busybox_tree),), memory_bytes=64 * MiB))
        try:
            h = await backend.exec("sb1", ExecSpec(argv=("sleep", "1000"), env={"PATH": "/bin"}))
            with pytest.raises(BadRequest, match="memory limit"):
                await backend.put_file("sb1", "/tmp/big", _mib(128))
            out, _, _ = await sh(backend, "sb1", "ls -a /tmp; ps -o comm | grep -c sleep")
            assert b"big" not in out and b"edged-put" not in out  # nothing left behind
            assert out.split()[-1] == b"1", "the workload was killed for the upload"
            await h.kill()
            # what fits still goes in
            assert await backend.put_file("sb1", "/tmp/ok", _mib(8)) == 8 * MiB
        finally:
            await backend.destroy("sb1")

    run(body)


def test_an_upload_over_the_disk_limit_is_refused(backend: ContainerBackend,
                                                  busybox_tree: Path) -> None:
    async def body() -> None:
        await backend.create(spec((str(busybox_tree),), disk_bytes=16 * MiB))
        try:
            with pytest.raises(BadRequest, match="disk limit"):
                await backend.put_file("sb1", "/tmp/big", _mib(32))
            out, _, _ = await sh(backend, "sb1", "ls -a /tmp")
            assert b"big" not in out and b"edged-put" not in out
            assert await backend.put_file("sb1", "/tmp/small", chunks(b"x" * 1000)) == 1000
        finally:
            await backend.destroy("sb1")

    run(body)


def test_an_oom_end_has_no_exit_code(backend: ContainerBackend, busybox_tree: Path) -> None:
    """``dd`` filling /tmp (RAM) past the memory limit is OOM-killed and the shell around it
    passes the status on (137). The end had said ``reason=oom`` with an exit code (0 on
    the code of the time, 137 now); the contract: an exit code only when the reason is
    ``exited``."""

    async def body() -> None:
        await backend.create(spec((str(busybox_tree),), memory_bytes=64 * MiB))
        try:
            _, _, end = await sh(backend, "sb1",
                                 "dd if=/dev/zero of=/tmp/fill bs=1M count=128; exit $?")
            assert end.reason == "oom" and end.exit_code is None and end.signal is None
            _, _, end = await sh(backend, "sb1", "rm /tmp/fill; exit 3")
            assert (end.reason, end.exit_code) == ("exited", 3)
        finally:
            await backend.destroy("sb1")

    run(body)
