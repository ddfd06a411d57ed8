"""Every byte an exec's process wrote before it exited reaches its events, under pressure.

Bug (issue 9, item 1): under CPU pressure an exec ended ``exited 0`` without a single stdout
event (17-42 of 400 ``echo`` execs at ``cpus: 0.05``; 13 of 200 beside a busy loop). sbx-init
ended an exec a fixed 20 ms (of wall time) after reaping its main process and closed the
pipes without reading what was still in them; throttled by the sandbox's CPU quota, it was
often not scheduled inside that window. Each test here counts the execs whose output did not
arrive whole and must count none. The larger variants are marked ``slow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edged.backends.base import ExecEnd, ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend
from edged.errors import BackendError
from tests.edged.execs import collect
from tests.timing import bound, repeats

pytestmark = [pytest.mark.root, pytest.mark.mount]

ENV = {"PATH": "/bin"}


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 300) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), bound(timeout)))  # type: ignore[arg-type]


@dataclass(repr=False)
class Tally:
    """Execs run and those whose output or end was not what the command wrote."""

    runs: int = 0
    lost: list[str] = field(default_factory=list)

    def check(self, what: str, got: tuple[bytes, bytes, ExecEnd],
              want_out: bytes, want_err: bytes = b"") -> None:
        self.runs += 1
        out, err, end = got
        if (out, err, end.reason, end.exit_code) != (want_out, want_err, "exited", 0):
            self.lost.append(f"{what}: stdout {out[:60]!r} ({len(out)} B), stderr "
                             f"{err[:60]!r} ({len(err)} B), {end.reason} {end.exit_code}")

    def assert_none_lost(self) -> None:
        lost, runs = len(self.lost), self.runs
        assert runs and not lost, f"{lost} of {runs} execs lost output: {self.lost[:5]}"


async def hammer(b: ContainerBackend, sids: list[str], n: int, concurrency: int,
                 argv: Callable[[int], tuple[str, ...]], want: Callable[[int], bytes],
                 want_err: Callable[[int], bytes] = lambda i: b"", **kw: Any) -> Tally:
    """``n`` execs per sandbox, ``concurrency`` at once in each; every one checked."""
    tally = Tally()

    async def worker(sid: str, ids: list[int]) -> None:
        while ids:
            i = ids.pop()
            h = await b.exec(sid, ExecSpec(argv=argv(i), env=ENV, **kw))
            tally.check(f"{sid}#{i}", await collect(h), want(i), want_err(i))

    jobs = []
    for sid in sids:
        ids = list(range(n))
        jobs += [worker(sid, ids) for _ in range(concurrency)]
    await asyncio.gather(*jobs)
    return tally


@asynccontextmanager
async def sandboxes(b: ContainerBackend, tree: Path, count: int,
                    **res: Any) -> AsyncIterator[list[str]]:
    sids = [f"integ{i}" for i in range(count)]
    try:
        for sid in sids:
            await b.create(SandboxSpec(id=sid, lowers=(str(tree),), resources=Resources(**res),
                                       env=ENV, hostname=sid))
        yield sids
    finally:
        for sid in sids:
            await b.destroy(sid)


@asynccontextmanager
async def busy_loops(b: ContainerBackend, sid: str) -> AsyncIterator[None]:
    """What agents do, a busy loop left running in the sandbox; and one on the host beside
    it (one core of two)."""
    h = await b.exec(sid, ExecSpec(argv=("sh", "-c", "while :; do :; done"), env=ENV))
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        p.kill()
        p.wait()
        await h.kill()
        await collect(h)


def echo(i: int) -> tuple[str, ...]:
    return ("echo", f"TAG{i}")


def tag(i: int) -> bytes:
    return f"TAG{i}\n".encode()


def none_lost(b: ContainerBackend, tree: Path, *, cpus: float, n: int, concurrency: int,
              count: int = 1, busy: bool = False,
              argv: Callable[[int], tuple[str, ...]] = echo, want: Callable[[int], bytes] = tag,
              want_err: Callable[[int], bytes] = lambda i: b"", **kw: Any) -> None:
    """``n`` execs in each of ``count`` sandboxes at ``cpus``, ``concurrency`` at once in
    each (``busy``: beside :func:`busy_loops`); fails unless every one delivered whole."""
    n = repeats(n, least=8)  # fewer on an emulated node (tests/timing.py)

    async def body() -> None:
        async with sandboxes(b, tree, count, cpus=cpus) as sids, \
                (busy_loops(b, sids[0]) if busy else contextlib.nullcontext()):
            tally = await hammer(b, sids, n, concurrency, argv, want, want_err, **kw)
        tally.assert_none_lost()

    run(body, timeout=max(300, n * count // 2))


def test_echo_at_a_starved_cpu_quota(backend: ContainerBackend, busybox_tree: Path) -> None:
    # the reproduction: 8 at once in one sandbox at cpus 0.05 (17-42 of 400 lost)
    none_lost(backend, busybox_tree, cpus=0.05, n=240, concurrency=8)


def test_both_streams_and_big_outputs_at_a_starved_cpu_quota(
        backend: ContainerBackend, busybox_tree: Path) -> None:
    # output larger than a pipe's buffer, on both streams: the last 64 KiB of each are in
    # the pipes when the process ends
    size = 200_000
    none_lost(backend, busybox_tree, cpus=0.05, n=24, concurrency=4,
              argv=lambda i: ("sh", "-c", f"head -c {size} /dev/zero; echo E{i} >&2; "
                                          f"head -c {i} /dev/zero"),
              want=lambda i: bytes(size + i), want_err=lambda i: f"E{i}\n".encode())


def test_pty_echo_at_a_starved_cpu_quota(backend: ContainerBackend, busybox_tree: Path) -> None:
    none_lost(backend, busybox_tree, cpus=0.05, n=60, concurrency=4,
              want=lambda i: f"TAG{i}\r\n".encode(), pty=True)


def test_echo_beside_busy_loops_inside_and_outside(backend: ContainerBackend,
                                                   busybox_tree: Path) -> None:
    # the issue: 13 of 200 lost at cpus 0.5 with a busy loop left running in the sandbox
    none_lost(backend, busybox_tree, cpus=0.5, n=400, concurrency=8, busy=True)


def test_echo_across_sandboxes(backend: ContainerBackend, busybox_tree: Path) -> None:
    # the issue: 41 of 1,600 lost across 20 sandboxes x 4 concurrent
    none_lost(backend, busybox_tree, cpus=0.1, n=30, concurrency=4, count=6)


@pytest.mark.slow
def test_echo_at_scale_under_pressure(backend: ContainerBackend, busybox_tree: Path) -> None:
    # the full figures: 400 at cpus 0.05; 20 sandboxes x 4 x 80, busy loops beside
    none_lost(backend, busybox_tree, cpus=0.05, n=400, concurrency=8)
    none_lost(backend, busybox_tree, cpus=0.5, n=80, concurrency=4, count=20, busy=True)


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def test_a_spare_killed_under_the_exec_never_passes_for_a_run(
        backend: ContainerBackend, busybox_tree: Path) -> None:
    # The next exec's child is forked ahead (the spare). Killed just as an exec is handed to
    # it, its end read as the program's (signalled 9, or "started" with no output): an exec
    # that never ran must fail as such, typed, and one that ran must deliver its output.
    async def body() -> None:
        async with sandboxes(backend, busybox_tree, 1, cpus=0.2) as sids:
            init = backend._get(sids[0]).pid
            tally = Tally()
            for i in range(repeats(60, least=15)):
                for kid in _children(init):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(kid, signal.SIGKILL)
                try:
                    h = await backend.exec(sids[0], ExecSpec(argv=echo(i), env=ENV))
                except BackendError as exc:
                    assert "before it could start" in str(exc), exc
                    continue
                tally.check(f"#{i}", await collect(h), tag(i))
            tally.assert_none_lost()

    run(body)


def test_a_timeout_racing_the_start_ends_timeout_and_keeps_output(
        backend: ContainerBackend, busybox_tree: Path) -> None:
    # Bug (issue 9, item 1): a timeout that passed before the exec's child reached execve (a
    # short timeout at a starved CPU quota) was answered "its process ended before it could
    # start the program" (BackendError, a 500), not as the timeout it was: 1-6 of 40 execs
    # at cpus 0.05 with 1-20 ms timeouts. Every exec here must end `timeout`, and one whose
    # program got as far as its marker (written after its echo) must have delivered the echo
    # (at load 120 test_timeout_kills_daemonized_tree saw no "started": its 0.5 s had passed
    # before the shell's echo; no output was lost).
    async def body() -> None:
        async with sandboxes(backend, busybox_tree, 1, cpus=0.05) as sids:
            sid, ends, outs, errors = sids[0], {}, {}, []

            async def one(i: int) -> None:
                try:
                    h = await backend.exec(sid, ExecSpec(
                        argv=("sh", "-c", f"echo started; touch /tmp/m{i}; sleep 5"),
                        env=ENV, timeout_s=0.001))
                except BackendError as exc:
                    errors.append(f"#{i}: {exc}")
                    return
                out, _err, end = await collect(h)
                ends[i], outs[i] = end, out

            for k in range(0, 40, 8):
                await asyncio.gather(*(one(i) for i in range(k, k + 8)))
            h = await backend.exec(sid, ExecSpec(argv=("ls", "/tmp"), env=ENV))
            listing, _, _ = await collect(h)
            marked = {int(m[1:]) for m in listing.decode().split() if m.startswith("m")}
        assert not errors, f"{len(errors)} of 40 timed-out execs reported as failures: " \
                           f"{errors[:3]}"
        assert {e.reason for e in ends.values()} == {"timeout"}, ends
        lost = [i for i in marked if outs[i] != b"started\n"]
        assert not lost, f"output lost by execs that wrote it: {[(i, outs[i]) for i in lost]}"
        assert all(out in (b"", b"started\n") for out in outs.values()), outs

    run(body)
