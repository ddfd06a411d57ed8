"""The pool's bookkeeping (:class:`edged.backends.microvm.pool.VmPool`) with fake clones:
refills one at a time and only after the create that took one has ended, dead clones
never handed out and replaced, a drain that holds refills off, close."""

from __future__ import annotations

import asyncio
import os

from edged.backends.microvm.pool import VmPool
from edged.backends.microvm.vmm import Machine


class Fake:
    """A clone: ``pid`` a process of its own that sleeps (so its pidfd works)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.dead = False

    def alive(self) -> bool:
        return not self.dead


class Starts:
    """``start``/``stop`` for the pool: counts starts, the most in flight at once."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.started: list[Fake] = []
        self.stopped: list[Fake] = []
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, machine: Machine) -> Fake:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.02)
            proc = await asyncio.create_subprocess_exec("sleep", "60")
            self.procs.append(proc)
            p = Fake(proc.pid)
            self.started.append(p)
            return p
        finally:
            self.running -= 1

    async def stop(self, p: Fake) -> None:
        self.stopped.append(p)
        for proc in self.procs:
            if proc.pid == p.pid and proc.returncode is None:
                proc.kill()
                await proc.wait()


M = Machine("k", "i", "c")


async def until(cond: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


def test_refills_one_at_a_time_after_the_create_and_replaces_the_dead() -> None:
    async def go() -> None:
        s = Starts()
        pool: VmPool[Fake] = VmPool(2, s.start, s.stop)
        a = b = got = None
        try:
            assert pool.take(M) is None  # nothing wanted yet
            pool.want(M)
            await until(lambda: pool.count() == 2)
            assert s.most == 1 and len(s.started) == 2
            # a burst of creates: each takes one; no start while a taker's create runs
            a, b = pool.take(M), pool.take(M)
            assert a is not None and b is not None and pool.take(M) is None
            pool.want(M)  # another create ended meanwhile: still none while these run
            await asyncio.sleep(0.1)
            assert len(s.started) == 2
            pool.done()
            pool.done()
            await until(lambda: pool.count() == 2)
            assert s.most == 1 and len(s.started) == 4
            # dead while it waits, seen at the take: skipped, removed, replaced
            w = pool.waiting()
            w[0].dead = True
            got = pool.take(M)
            assert got is w[1] and pool.replaced == 1
            pool.done()
            await until(lambda: w[0] in s.stopped and pool.count() == 2)
            # killed while it waits (its pidfd): replaced without a take
            victim = pool.waiting()[0]
            os.kill(victim.pid, 9)  # a sleep this test started
            await until(lambda: victim in s.stopped and pool.count() == 2
                        and victim not in pool.waiting())
            assert pool.replaced == 2
            # short of memory: all go, none is started for the hold
            assert pool.drain(hold_s=2.0) == 2 and pool.count() == 0
            n = len(s.started)
            await asyncio.sleep(0.5)
            assert len(s.started) == n
            await until(lambda: pool.count() == 2)
            # another machine: the least recent beyond MACHINES ends
            for i in range(3):
                pool.want(Machine("k", "i", f"c{i}"))
            await until(lambda: pool.count() == 4)
            assert pool.take(M) is None
        finally:
            await pool.close()
            for proc in s.procs:  # the taken ones are their creates' (here: ours)
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        # every clone started was taken by a create or ended by the pool
        assert pool.count() == 0
        assert all(p in s.stopped or p in (a, b, got) for p in s.started)

    asyncio.run(go())
