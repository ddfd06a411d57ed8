"""Red team: what the agent leaves running before grading (a background tamper loop that
rewrites the answer file, a fork bomb holding the pids limit) is stopped by
``kill_processes`` / ``kill_leftovers``, so that the grader's exec starts and sees its own
writes. An exec refused at the pids limit is a typed error (PidsExhausted, HTTP 409), never
a backend failure (500)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edged.errors import BackendError, PidsExhausted
from tests.edged.execs import eventually
from tests.security.conftest import Node, execv, run, sh, spec

pytestmark = [pytest.mark.root, pytest.mark.mount]

TAMPER = "(while :; do echo tampered > /work/answer; done) >/dev/null 2>&1 </dev/null &"
GRADER = "echo mine > /work/answer; sleep 0.3; cat /work/answer"


async def _fill_pids(node: Node, sid: str) -> None:
    """Start the tamper loop and the bomb; wait until an exec is refused for want of pids."""
    b = node.backend
    await sh(b, sid, TAMPER)
    await execv(b, sid, ("/usr/bin/attack", "forkbomb"))
    refused = 0
    for _ in range(200):
        try:
            await sh(b, sid, "true", timeout_s=2)
        except PidsExhausted:
            refused += 1
            if refused >= 2:
                return
        except BackendError as exc:  # what the bug gave: a 500 for a full sandbox
            raise AssertionError(f"exec at the pids limit: untyped backend error {exc}") from exc
        await asyncio.sleep(0.02)
    raise AssertionError("the fork bomb never reached the pids limit")


def test_kill_processes_then_grader(node: Node, rootfs: Path) -> None:
    b = node.backend

    async def body() -> None:
        await b.create(spec(rootfs, "left", pids=48))
        try:
            await _fill_pids(node, "left")
            killed = await b.kill_processes("left")
            assert killed >= 10, killed  # the bomb held the rest of the 48 pids
            # sbx-init (and the spare child it forks ahead); the killed tasks are gone from
            # pids.current once they have exited, a while later on a loaded host (46 seen)
            await eventually(lambda: b.stats("left"), lambda st: st["pids"] <= 3,
                             "the killed tasks gone from the pids count")
            out, _, end = await sh(b, "left", GRADER, trusted=True)
            assert end.reason == "exited" and end.exit_code == 0, end
            assert out == "mine\n", out
        finally:
            await b.destroy("left")

    run(body)


def test_kill_leftovers_before_grader(node: Node, rootfs: Path) -> None:
    b = node.backend

    async def body() -> None:
        await b.create(spec(rootfs, "left2", pids=48))
        try:
            await _fill_pids(node, "left2")
            out, _, end = await sh(b, "left2", GRADER, trusted=True, kill_leftovers=True)
            assert end.reason == "exited" and end.exit_code == 0, end
            assert out == "mine\n", out
        finally:
            await b.destroy("left2")

    run(body)
