"""An idle sandbox keeps no spare: sbx-init forks each exec's child ahead of it (the spare, off
the exec's latency) and drops it once no exec has started or ended for ``spare_idle_s``
(host kernel memory no limit holds: its task, kernel stack, page tables and exec cgroup);
the next exec forks its own child, in its own exec cgroup, and the spare comes back at that
exec's end. Also on a starved CPU quota and at a full pids limit (a typed refusal, never a
run that passes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from edged.backends.base import ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend, from_config
from edged.config import Config
from edged.errors import BadRequest, PidsExhausted
from tests.edged.execs import collect, eventually, gone

pytestmark = [pytest.mark.root, pytest.mark.mount]

ENV = {"PATH": "/bin"}
IDLE_S = 0.5
T = TypeVar("T")


def now(fn: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    """``fn`` as the probe of :func:`eventually`."""
    async def probe() -> T:
        return fn()
    return probe


def spec(lowers: tuple[str, ...], sid: str, **res: Any) -> SandboxSpec:
    return SandboxSpec(id=sid, lowers=lowers, resources=Resources(**res), env=ENV,
                       hostname=sid)


def run(coro_fn: Any) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 180))


@pytest.fixture
def idle_backend(state_dir: Path) -> ContainerBackend:
    b = ContainerBackend(state_dir, spare_idle_s=IDLE_S)
    if not (b.bin_dir / "edged-spawner").exists():
        pytest.skip("edged/_bin not built: run `pip install -e .`")
    return b


def _inits(b: ContainerBackend, sid: str) -> list[int]:
    """sbx-init and its spare (a fork of it: the same program) among the sandbox's tasks."""
    out = []
    for p in b._sandboxes[sid].cg.procs():
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() == "sbx-init":
                out.append(p)
        except OSError:
            pass  # gone meanwhile
    return out


def _exec_cgroups(b: ContainerBackend, sid: str) -> list[str]:
    """The exec cgroups beneath the sandbox's (freezer on v1, the one hierarchy on v2, where
    sbx-init's own leaf, ``init``, is beside them and not one)."""
    dirs = b._sandboxes[sid].cg.dirs
    top = dirs.get("freezer") or dirs["v2"]
    return sorted(d.name for d in top.iterdir() if d.is_dir() and d.name != "init")


async def _settled(b: ContainerBackend, sid: str, spare: bool) -> list[int]:
    """Wait until the sandbox has its spare (``spare``) or has none and no exec cgroup is
    left (its spare's removed once it was reaped); returns sbx-init's and the spare's pids."""
    want = 2 if spare else 1

    async def probe() -> tuple[list[int], list[str]]:
        return _inits(b, sid), _exec_cgroups(b, sid)

    got = await eventually(probe, lambda g: len(g[0]) == want and (spare or not g[1]),
                           f"sbx-init {'with' if spare else 'without'} its spare")
    return got[0]


async def _dropped(b: ContainerBackend, sid: str) -> None:
    """Wait for the spare to be made (after the last exec's end), then dropped."""
    init = b._sandboxes[sid].pid
    await eventually(now(lambda: len(_inits(b, sid))), lambda n: n == 2, "the spare made")
    await eventually(now(lambda: _inits(b, sid)), lambda p: p == [init], "the spare dropped")


def _runs(pid: int) -> int:
    """Timeslices ``pid`` got so far (``/proc/<pid>/schedstat``, 3rd field)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[2])


async def sh(b: ContainerBackend, sid: str, script: str) -> tuple[bytes, bytes, Any]:
    return await collect(await b.exec(sid, ExecSpec(argv=("sh", "-c", script), env=ENV)))


async def _exec_without_spare(b: ContainerBackend, sid: str) -> None:
    """An exec started with no spare: complete output, a typed end, its own exec cgroup;
    the spare back after it."""
    key = "0::" if b.cgroups.version == "v2" else ":freezer:"
    out, err, end = await sh(b, sid, f"grep {key} /proc/self/cgroup; head -c 1048576 /dev/zero"
                                     " | tr '\\0' x; echo; echo oops >&2; exit 3")
    lines = out.split(b"\n")
    assert lines[0].decode().rsplit("/", 1)[-1].startswith("e"), out[:200]  # an exec cgroup
    assert lines[1] == b"x" * (1 << 20), len(lines[1])
    assert err == b"oops\n"
    assert (end.reason, end.exit_code) == ("exited", 3), end


def test_an_idle_sandbox_drops_its_spare_and_gets_it_back(idle_backend: ContainerBackend,
                                                          busybox_tree: Path) -> None:
    b = idle_backend

    async def body() -> None:
        await b.create(spec((str(busybox_tree),), "sp1"))
        try:
            init = b._sandboxes["sp1"].pid
            out, _, end = await sh(b, "sp1", "echo hi")
            assert (out, end.exit_code) == (b"hi\n", 0)
            spare = next(p for p in await _settled(b, "sp1", spare=True) if p != init)
            # idle: the spare goes, and with it its exec cgroup; 1 process is left
            assert await _settled(b, "sp1", spare=False) == [init]
            assert gone(spare)
            assert b._sandboxes["sp1"].cg.procs() == [init]
            # and it stays so: no timer comes back (an idle sandbox never runs)
            before = _runs(init)
            await asyncio.sleep(3 * IDLE_S + 1)
            assert b._sandboxes["sp1"].cg.procs() == [init]
            assert _runs(init) == before
            await _exec_without_spare(b, "sp1")
            await _settled(b, "sp1", spare=True)  # back at the exec's end
            await _settled(b, "sp1", spare=False)  # and gone again when idle
            # an exec's tree is still killed whole without a spare (its exec cgroup)
            h = await b.exec("sp1", ExecSpec(argv=("sh", "-c", "sleep 1000 & sleep 1000"),
                                             env=ENV))
            await eventually(now(lambda: len(b._sandboxes["sp1"].cg.procs())),
                             lambda n: n >= 3, "the exec's two sleeps")
            await h.kill()
            _, _, end = await collect(h)
            assert end.reason == "killed", end
            await eventually(now(lambda: _exec_cgroups(b, "sp1")),
                             lambda cgs: len(cgs) <= 1, "the killed exec's cgroup removed")
            assert all(Path(f"/proc/{p}/comm").read_text().strip() == "sbx-init"
                       for p in b._sandboxes["sp1"].cg.procs())
        finally:
            await b.destroy("sp1")

    run(body)


def test_spare_dropped_and_back_on_a_starved_quota(idle_backend: ContainerBackend,
                                                   busybox_tree: Path) -> None:
    """cpus 0.05 with a busy loop of the sandbox's own in the same quota: the spare is still
    dropped (killed, it needs no CPU of its own to go), and the execs after it run whole."""
    b = idle_backend

    async def body() -> None:
        await b.create(spec((str(busybox_tree),), "sp2", cpus=0.05))
        try:
            out, _, end = await sh(b, "sp2", "while :; do :; done > /dev/null 2>&1 & echo bg")
            assert (out, end.exit_code) == (b"bg\n", 0)
            await _dropped(b, "sp2")
            for _ in range(2):
                await _exec_without_spare(b, "sp2")
                await _dropped(b, "sp2")
        finally:
            await b.destroy("sp2")

    run(body)


def test_exec_at_a_full_pids_limit_without_a_spare(idle_backend: ContainerBackend,
                                                   busybox_tree: Path) -> None:
    """With the spare gone, the exec's child must be forked: at a full pids limit that is a
    typed refusal naming fork (never a run that passes), and once there is room the execs
    run and the spare is back."""
    b = idle_backend

    async def body() -> None:
        await b.create(spec((str(busybox_tree),), "sp3", pids=16))
        try:
            out, _, end = await sh(b, "sp3", "for i in 1 2 3; do sleep 1000 & done; echo bg")
            assert (out, end.exit_code) == (b"bg\n", 0)
            init = b._sandboxes["sp3"].pid
            await _dropped(b, "sp3")
            cg = b.cgroups.path_of("sp3")
            pids = cg.dirs.get("pids") or cg.dirs["v2"]
            (pids / "pids.max").write_text((pids / "pids.current").read_text())
            for _ in range(2):
                with pytest.raises(PidsExhausted, match="fork"):
                    await sh(b, "sp3", "echo should-not-run")
            assert _inits(b, "sp3") == [init]  # no spare either: it could not be forked
            (pids / "pids.max").write_text("16")
            out, _, end = await sh(b, "sp3", "echo ran")
            assert (out, end.reason, end.exit_code) == (b"ran\n", "exited", 0)
            await eventually(now(lambda: len(_inits(b, "sp3"))),
                             lambda n: n == 2, "the spare back")
        finally:
            await b.destroy("sp3")

    run(body)


def test_spare_kept_without_spare_idle(backend: ContainerBackend, busybox_tree: Path) -> None:
    """spare_idle_s 0 (the backend's default): the spare stays, however long it is idle."""
    async def body() -> None:
        await backend.create(spec((str(busybox_tree),), "sp4"))
        try:
            await sh(backend, "sp4", "true")
            first = await _settled(backend, "sp4", spare=True)
            await asyncio.sleep(2.5)
            assert _inits(backend, "sp4") == first
        finally:
            await backend.destroy("sp4")

    run(body)


def test_spare_idle_values(state_dir: Path) -> None:
    """The daemon's config reaches sbx-init; out-of-range values are refused where they
    enter (config, backend, spawner, sbx-init), each with a clear error."""
    assert from_config(Config(spare_idle_s=2.5), None).spare_idle_ms == 2500
    assert Config().spare_idle_s == 10.0
    with pytest.raises(BadRequest, match="spare_idle_s"):
        Config(spare_idle_s=-1).validate()
    for seconds in (-1.0, float("inf"), float("nan"), 1e12):
        with pytest.raises(BadRequest, match="spare_idle_s"):
            ContainerBackend(state_dir, spare_idle_s=seconds)
    bin_dir = ContainerBackend(state_dir).bin_dir
    for bad in ("", "x", "-5", "1e3", "9999999999999"):
        r = subprocess.run([str(bin_dir / "edged-spawner"), "--status-fd", "1", "--uid-base",
                            "1000000", "--spare-idle-ms", bad], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 1 and "--spare-idle-ms" in r.stdout + r.stderr, (bad, r)
        # sbx-init refuses it before doing anything else
        r = subprocess.run([str(bin_dir / "sbx-init"), "-I", bad, "-l", "99"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "-I" in r.stderr, (bad, r)
    assert not os.path.exists(state_dir / "sandboxes")
