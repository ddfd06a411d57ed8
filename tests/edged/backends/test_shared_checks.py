"""What the backends share from ``edged.backends.base``: the exec-spec check, the per-instance
cgroup subdirectory, the pidfd wait (each was written once per backend) and the memory half
of a backend without a memory policy (the FnCall backend's, the test fake's)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edged.backends.base import (
    ExecSpec,
    MemoryUsage,
    NoReclaim,
    Resources,
    SandboxSpec,
    instance_subdir,
    readable,
)
from edged.backends.uidslots import UidSlots
from edged.errors import BadRequest


def spec(**kw: object) -> ExecSpec:
    return ExecSpec(argv=("true",), env={}, **kw)  # type: ignore[arg-type]


def test_exec_spec_check_refuses_what_no_backend_can_run() -> None:
    spec(uid=0, gid=65535, timeout_s=1.0, output_limit=1).check(65536)
    for bad in (dict(uid=65536), dict(gid=-1), dict(timeout_s=0.0), dict(timeout_s=-1.0),
                dict(output_limit=0)):
        with pytest.raises(BadRequest):
            spec(**bad).check(65536)
    with pytest.raises(BadRequest, match=r"id range 0\.\.9"):
        spec(uid=10).check(10)


def test_instance_subdir_is_plain_for_the_system_daemon_and_hashed_elsewhere(
        tmp_path: Path) -> None:
    assert instance_subdir("edged", tmp_path, tmp_path.resolve()) == "edged"
    a = instance_subdir("edged", tmp_path / "a", Path("/run/edged"))
    b = instance_subdir("edged", tmp_path / "b", Path("/run/edged"))
    assert a.startswith("edged-") and len(a) == len("edged-") + 10 and a != b
    assert a == instance_subdir("edged", tmp_path / "a", Path("/run/edged"))


def test_uid_slots_default_to_the_whole_grid(tmp_path: Path) -> None:
    s = UidSlots(tmp_path, uid_base=1 << 30, id_count=65536, directory=tmp_path / "slots")
    assert s.max_slots == ((1 << 32) - 2 - (1 << 30)) // 65536
    assert UidSlots(tmp_path, uid_base=0, id_count=10, max_slots=3,
                    directory=tmp_path / "s2").max_slots == 3


def test_readable_is_done_when_the_pidfds_process_ends_and_unwatches_it() -> None:
    async def main() -> None:
        p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
        fd = os.pidfd_open(p.pid)
        try:
            loop = asyncio.get_running_loop()
            with readable(fd) as ended:
                await asyncio.sleep(0.2)
                assert not ended.done()  # still running
                assert p.stdin is not None
                p.stdin.close()
                await asyncio.wait_for(ended, 10.0)
            assert not loop.remove_reader(fd)  # no longer watched
            with readable(fd) as ended:  # an ended process: done at once
                await asyncio.wait_for(ended, 10.0)
            with readable(fd) as left:  # left before it is done: cancelled
                pass
            assert left.cancelled()
        finally:
            os.close(fd)
            p.wait()

    asyncio.run(main())


def test_no_reclaim_frees_nothing_and_counts_zeros() -> None:
    b = NoReclaim()
    assert b.can_reclaim is False
    assert asyncio.run(b.reclaim("s", 1 << 20)) == 0
    assert asyncio.run(b.prefetch("s")) is None
    assert b.totals() == MemoryUsage()
    b.set_memory_limit(1 << 30)


def test_sandbox_spec_check_refuses_what_no_backend_can_create() -> None:
    def sbx(**kw: object) -> SandboxSpec:
        base: dict[str, object] = dict(id="a-1", lowers=("/l",), resources=Resources(),
                                       env={}, hostname="h")
        return SandboxSpec(**{**base, **kw})  # type: ignore[arg-type]

    sbx().check()
    sbx(hostname="x" * 64, qos="latency_sensitive").check()
    for bad, says in ((dict(id="A"), "sandbox id"), (dict(id="a" * 64), "sandbox id"),
                      (dict(lowers=()), "lowers"), (dict(qos="gold"), "qos"),
                      (dict(hostname=""), "hostname"), (dict(hostname="x" * 65), "hostname"),
                      (dict(hostname="a\0b"), "hostname"),
                      (dict(resources=Resources(cpus=0)), "resources"),
                      (dict(resources=Resources(swap_bytes=-1)), "resources")):
        with pytest.raises(BadRequest, match=says):
            sbx(**bad).check()
