"""A pool of clones started ahead of their sandboxes: what a create then no longer waits
for is the VMM's start and the template state's load (:meth:`.guest.GuestVm.prestart`).

Per machine (:meth:`~.vmm.Machine.key`: RAM, vCPUs, disks, upper size), up to ``size``
clones wait, each a VMM of its own (uid slot, cgroups, run and data directories: the
backend's, see :mod:`.backend`). The pool keeps the machines of the last creates
(:data:`MACHINES` of them, the least recently used one's clones end when another comes).

- **Refill in the background**, never on a create's path: one worker starts one clone at a
  time (two cores, and a QEMU start is ~0.1 CPU-s under TCG: a burst of creates must not
  start N more), after the create that took one has ended (:meth:`VmPool.done`), with a
  back-off after a failed start.
- **A clone that died** (its VMM killed, its guest crashed) is noticed at once (a pidfd of
  its VMM), removed and replaced; :meth:`VmPool.take` checks again that the VMM runs, so a
  dead one is never handed out.
- **Memory**: a waiting clone holds what its VMM touched (~60-90 MiB here, most of it
  shared with the template's page cache); :meth:`VmPool.drain` ends them all and holds
  refills off for a while (the node's admission calls it when it is short of memory).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

from edged.backends.microvm.vmm import Machine

log = logging.getLogger("edged.microvm")

#: Machines whose clones are kept (the most recently created ones).
MACHINES = 2
#: Seconds a failed start holds the next one off (doubling up to :data:`MAX_BACKOFF_S`).
BACKOFF_S = 2.0
MAX_BACKOFF_S = 60.0
#: Seconds :meth:`VmPool.drain` holds refills off by default.
DRAIN_HOLD_S = 30.0


class Pooled(Protocol):
    """A clone waiting in the pool: ``pid`` of its VMM."""

    @property
    def pid(self) -> int:
        """Its VMM's process id."""
        ...

    def alive(self) -> bool:
        """Whether its VMM still runs."""
        ...


P = TypeVar("P", bound=Pooled)


class VmPool(Generic[P]):
    """Clones ready per machine. ``start(machine)`` makes one (raises on failure, leaving
    nothing); ``stop(p)`` ends one and removes all of it (never raises). ``size``: clones
    per machine (0: no pool)."""

    def __init__(self, size: int, start: Callable[[Machine], Coroutine[Any, Any, P]],
                 stop: Callable[[P], Coroutine[Any, Any, None]]) -> None:
        self.size = size
        self._start = start
        self._stop = stop
        self._machines: collections.OrderedDict[str, Machine] = collections.OrderedDict()
        self._ready: dict[str, list[P]] = {}
        self._pidfds: dict[int, int] = {}  # id(p) -> pidfd watched
        self._wake = asyncio.Event()
        self._busy = 0  # creates that took a clone and have not ended
        self._hold_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        self._closed = False
        self.started = 0  # clones started (for tests and stats)
        self.replaced = 0  # clones found dead and replaced

    # ---- what the backend asks ---------------------------------------------------------

    def want(self, machine: Machine) -> None:
        """Keep clones of ``machine`` from now on (it becomes the most recent machine)."""
        if self.size <= 0 or self._closed:
            return
        key = machine.key()
        self._machines[key] = machine
        self._machines.move_to_end(key)
        while len(self._machines) > MACHINES:
            old, _ = self._machines.popitem(last=False)
            for p in self._ready.pop(old, []):
                self._drop(p)
        self._kick()

    def take(self, machine: Machine) -> P | None:
        """A clone of ``machine`` whose VMM runs (removed from the pool), or None. The
        caller must call :meth:`done` once its create has ended."""
        ready = self._ready.get(machine.key(), [])
        while ready:
            p = ready.pop(0)
            self._unwatch(p)
            if p.alive():
                self._busy += 1
                return p
            self.replaced += 1
            log.warning("microvm pool: clone (VMM %d) died while it waited", p.pid)
            self._end(p)
        return None

    def done(self) -> None:
        """A create that took a clone has ended: refills may go on."""
        self._busy = max(0, self._busy - 1)
        self._kick()

    def count(self) -> int:
        """Clones waiting now."""
        return sum(len(v) for v in self._ready.values())

    def waiting(self) -> list[P]:
        """The clones waiting now."""
        return [p for v in self._ready.values() for p in v]

    def drain(self, hold_s: float = DRAIN_HOLD_S) -> int:
        """End every waiting clone and start none for ``hold_s`` seconds; returns how many
        were ended."""
        n = 0
        for ps in self._ready.values():
            for p in ps:
                self._drop(p)
                n += 1
            ps.clear()
        self._hold_until = max(self._hold_until, time.monotonic() + hold_s)
        if n:
            log.info("microvm pool: drained %d clones (refills held %.0f s)", n, hold_s)
        self._kick()
        return n

    async def close(self) -> None:
        """End the worker and every waiting clone, and wait until they are gone. The pool
        stays usable: the next :meth:`want` starts filling it again."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        for ps in self._ready.values():
            for p in ps:
                self._drop(p)
        self._ready.clear()
        self._machines.clear()
        while self._stopping:
            await asyncio.gather(*list(self._stopping), return_exceptions=True)
        self._hold_until = 0.0
        self._closed = False

    # ---- the worker --------------------------------------------------------------------

    def _kick(self) -> None:
        if self._closed or self.size <= 0:
            return
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _short(self) -> Machine | None:
        """The most recent machine with fewer clones than ``size``, or None."""
        for key in reversed(self._machines):
            if len(self._ready.get(key, [])) < self.size:
                return self._machines[key]
        return None

    async def _run(self) -> None:
        backoff = 0.0
        while not self._closed:
            machine = self._short()
            wait = self._hold_until - time.monotonic()
            if machine is None or self._busy or wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait if wait > 0 else None)
                continue
            try:
                p = await self._start(machine)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                backoff = min(MAX_BACKOFF_S, backoff * 2 or BACKOFF_S)
                log.warning("microvm pool: a clone did not start (next try in %.0f s): %s",
                            backoff, exc)
                self._hold_until = max(self._hold_until, time.monotonic() + backoff)
                continue
            backoff = 0.0
            self.started += 1
            key = machine.key()
            if self._closed or key not in self._machines:
                self._end(p)  # the machine was dropped (or the pool closed) meanwhile
                continue
            self._ready.setdefault(key, []).append(p)
            self._watch(p, key)

    # ---- clones that die ---------------------------------------------------------------

    def _watch(self, p: P, key: str) -> None:
        try:
            fd = os.pidfd_open(p.pid)
        except ProcessLookupError:
            asyncio.get_running_loop().call_soon(self._died, p, key)
            return
        self._pidfds[id(p)] = fd
        asyncio.get_running_loop().add_reader(fd, self._died, p, key)

    def _unwatch(self, p: P) -> None:
        fd = self._pidfds.pop(id(p), None)
        if fd is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _died(self, p: P, key: str) -> None:
        """The VMM of a waiting clone ended: remove it and start another."""
        ready = self._ready.get(key, [])
        if p not in ready:
            return
        ready.remove(p)
        self.replaced += 1
        log.warning("microvm pool: clone (VMM %d) died while it waited; replacing it", p.pid)
        self._drop(p)
        self._kick()

    def _drop(self, p: P) -> None:
        self._unwatch(p)
        self._end(p)

    def _end(self, p: P) -> None:
        t = asyncio.get_running_loop().create_task(self._stop(p))
        self._stopping.add(t)
        t.add_done_callback(self._stopping.discard)


__all__ = ["DRAIN_HOLD_S", "MACHINES", "Pooled", "VmPool"]
