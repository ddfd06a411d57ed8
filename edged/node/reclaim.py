"""Idle detection and cold-page reclaim for the node's sandboxes.

A sandbox is **idle** when it runs no exec, nothing touched it through the API for
``idle_after_s``, and its CPU demand was less than ``idle_cpu`` of a core over a window of
``idle_after_s`` measured from its cgroup: the CPU it used plus the time its tasks waited
for one (a daemonized loop inside keeps it awake, also when the node's CPU is so busy that
the loop gets almost none). An
idle sandbox has its cold pages reclaimed into the node's swap (the zram device of
:mod:`edged.node.swap`, or the host's swap) by the backend: cgroup v2 ``memory.reclaim``,
v1 ``process_madvise(MADV_PAGEOUT)``. Its first request afterwards wakes it: its pages come
back on use (faults from zram: microseconds each), and :class:`Reclaimer` measures that wake.
A reclaimed sandbox is checked again ``recheck_s`` after its reclaim, then, each time it is
found as it was (no CPU, no regrowth), after twice as long as before, up to ``recheck_max_s``
(a check reads its cgroup's memory and CPU files: at 3,200 reclaimed sandboxes every 60 s
that was most of the idle daemon's CPU); one whose resident memory grew back (a background
task woke up) is reclaimed again once it is idle again. Any request to a sandbox
(:meth:`Reclaimer.woke`) starts it over.

Pace (after Meta's TMO/Senpai, which steps ``memory.reclaim`` by PSI): one pass every
``interval_s`` reclaims sandboxes until a byte budget is spent. The budget follows the host's
memory pressure: when the share of time tasks stalled on memory over the last pass
(``/proc/pressure/memory`` ``some``) rises above ``psi_target`` percent, it halves; below
half of it, it grows back by a quarter, up to ``rate_bytes`` per second. Reclaim itself costs
CPU (compression) and, done to sandboxes that are not quite idle, refaults; both show up as
pressure first (our own reclaim writes do not, measured: cgroup v1 ``memory.force_empty``
~60% of the wall time moved the host's ``some`` total by 3 ms in 10 s; what the kernel
counts is reclaim entered by a task's own allocation or charge, and kswapd's).

Under a memory shortage (MemAvailable below ``low_bytes``) reclaim is the cure, not a cause:
a pass's budget is at least the deficit (``low_bytes`` − MemAvailable, up to ``rate_bytes``
× ``interval_s``) whatever the pressure, the biggest idle sandboxes go first, and a sandbox
is idle sooner: after ``short_idle_after_s`` (3 s) quiet and a CPU window as long, not 30 +
30 s (creates had outrun reclaim: a wave of Python sandboxes at ~6 creates a second held
MemAvailable at admission's reserve, each sandbox waiting a minute, then 20 s, to be
reclaimed, with the budget halved by the stall the shortage itself caused: kswapd's, the
creates'). :meth:`Reclaimer.rate` is the bytes a second reclaim freed lately: admission's
Retry-After for a create refused for memory is the time that rate takes to free what is
missing.

Swap full: a pass that finds no room in swap for any sandbox due (see ``swap_room``) makes
the passes after it do nothing for two passes, then look at the room alone (no sandbox), the
wait doubling while it stays full, up to ``recheck_max_s``; a sandbox deleted ends the wait.
Reclaim into a zram device at its RAM limit compresses each page and fails to store it (the
page stays resident): with the zram full, the daemon spent a whole core on that.

Counters kept per sandbox (for ``/metrics`` and ``GET /v1/node``): resident and swapped
bytes when last read, bytes reclaimed (sum over reclaims), wakes. The refault rate of
reclaimed sandboxes is major faults since their last reclaim per minute, over the resident
size they had before it (the working set, Google's far-memory metric: goal ≤ 0.2 %/min).

Sources: Documentation/admin-guide/cgroup-v2.rst (``memory.reclaim``, ``memory.pressure``),
Documentation/accounting/psi.rst; TMO (Weiner et al., ASPLOS '22); DSec §5.2 (pause = freeze,
swap, reclaim).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from edged.backends.base import MemoryUsage
from edged.errors import EdgedError
from edged.node import hostmem
from edged.periodic import Periodic

log = logging.getLogger("edged.reclaim")

PAGE = 4096


class _Record(Protocol):
    """What reclaim reads of a running sandbox's record
    (:class:`edged.node.sandbox.SandboxRecord`)."""

    id: str
    last_active: float
    active_execs: int

    @property
    def paused(self) -> bool: ...


@dataclass
class ReclaimConfig:
    """Knobs (see the module docstring); seconds, bytes, percent of wall time."""

    enabled: bool = True
    idle_after_s: float = 30.0
    short_idle_after_s: float = 3.0
    idle_cpu: float = 0.01
    interval_s: float = 2.0
    recheck_s: float = 60.0
    recheck_max_s: float = 600.0
    rate_bytes: int = 512 << 20
    psi_target: float = 1.0
    low_bytes: int = 0
    regrow_bytes: int = 1 << 20


@dataclass
class SandboxReclaim:
    """Reclaim's view of one sandbox."""

    last: MemoryUsage = field(default_factory=MemoryUsage)
    read_at: float = 0.0  # wall clock of ``last``
    cpu_mark: tuple[float, int] | None = None  # (wall time, cpu + wait ns) the window began
    next_check: float = 0.0
    recheck_every: float = 0.0  # seconds to the next check of a reclaimed, unchanged one
    reclaimed: bool = False
    reclaimed_at: float = 0.0
    working_set: int = 0  # resident bytes just before the last reclaim
    resident_after: int = 0  # and just after it
    faults_at_reclaim: int = 0
    reclaimed_bytes: int = 0  # total over reclaims
    reclaims: int = 0
    wakes: int = 0


@dataclass
class PassResult:
    """What one pass did: sandboxes reclaimed, bytes their resident memory went down by,
    the budget it had, the memory stall share (percent) seen since the last pass, the idle
    sandboxes left unreclaimed because swap had no room for them."""

    reclaimed: list[str] = field(default_factory=list)
    bytes: int = 0
    budget: int = 0
    stall_pct: float = 0.0
    swap_full: int = 0


class Reclaimer:
    """Runs idle detection and reclaim passes over the sandboxes ``records()`` yields, through
    ``backend`` (its ``memory``/``reclaim``; one whose ``can_reclaim`` is false is never
    reclaimed); ``records()`` yields the records of running and paused sandboxes (a paused
    one is paged out by its pause, never here, and its counters are kept). ``psi_path``
    and ``meminfo_path`` are the host's files (tests give their own); ``clock`` is wall time
    in seconds. ``ensure_swap`` is called before each reclaim (the swap is set up at the first).
    ``swap_room`` returns the bytes of pages swap can take now (None: unknown, no bound): a
    sandbox whose anonymous and tmpfs memory does not fit is not reclaimed (its pages would
    stay resident, and a zram device at its RAM limit fails each write), the pass counts it
    in :attr:`PassResult.swap_full`. Errors of one sandbox are logged and never stop a
    pass."""

    def __init__(self, cfg: ReclaimConfig, backend: Any,
                 records: Callable[[], Iterable[_Record]], *,
                 psi_path: str = hostmem.PRESSURE + "/memory",
                 meminfo_path: str = hostmem.MEMINFO,
                 clock: Callable[[], float] = time.time,
                 on_reclaimed: Callable[[str, int], None] | None = None,
                 ensure_swap: Callable[[], bool] | None = None,
                 swap_room: Callable[[], int | None] | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.records = records
        self.psi_path = psi_path
        self.meminfo_path = meminfo_path
        self.clock = clock
        self.on_reclaimed = on_reclaimed
        self.ensure_swap = ensure_swap
        self.swap_room = swap_room
        #: sandboxes the last pass left unreclaimed for want of swap room
        self.swap_full = 0
        self.state: dict[str, SandboxReclaim] = {}
        self.budget = int(cfg.rate_bytes * cfg.interval_s)
        self._psi_total: tuple[float, int] | None = None
        #: (wall time, bytes freed) of recent reclaims, for :meth:`rate`
        self._freed: collections.deque[tuple[float, int]] = collections.deque()
        self._loop = Periodic(self.pass_once, lambda: self.cfg.interval_s, "reclaim pass",
                              log)
        self._lock = asyncio.Lock()  # one reclaim at a time: it is CPU-bound (compression)
        self.passes = 0
        #: swap had no room for any sandbox due: passes do nothing until ``_full_until``,
        #: then look at the room alone (see _swap_still_full); 0: not full
        self._full_backoff = 0.0
        self._full_until = 0.0
        self._full_need = 0  # the least a sandbox found due then needed

    @property
    def supported(self) -> bool:
        """Whether the backend can report and reclaim memory."""
        return bool(self.backend.can_reclaim)

    # -- per-sandbox events ---------------------------------------------------------------

    def _st(self, sid: str) -> SandboxReclaim:
        st = self.state.get(sid)
        if st is None:
            st = self.state[sid] = SandboxReclaim()
        return st

    def woke(self, sid: str) -> bool:
        """A request reached sandbox ``sid``: it is awake (its idle clock restarts). Returns
        whether it had been reclaimed (the caller times the wake)."""
        st = self.state.get(sid)
        if st is None:
            return False
        was = st.reclaimed
        if was:
            st.wakes += 1
        st.reclaimed = False
        st.cpu_mark = None
        st.next_check = 0.0
        st.recheck_every = 0.0
        return was

    def forget(self, sid: str) -> None:
        """Drop what is known of a sandbox that is gone (its swap is free again: a full
        swap is looked at again at the next pass)."""
        self.state.pop(sid, None)
        self._full_until = 0.0

    async def reclaim_now(self, sid: str) -> int:
        """Reclaim sandbox ``sid`` at once, whatever its idleness (a pause). Returns the bytes
        its resident memory went down by; 0 if the backend cannot reclaim. Raises
        :class:`EdgedError` from the backend."""
        if not self.supported:
            return 0
        async with self._lock:
            st = self._st(sid)
            room = await self._room()
            use = await self.backend.memory(sid) if room is not None else st.last
            if room is not None and room < use.anon_bytes + use.shmem_bytes:
                log.warning("reclaim: sandbox %s: not paged out, swap has no room (%d MiB)",
                            sid, room >> 20)
                return 0
            return await self._reclaim(sid, st, self.clock())

    async def _reclaim(self, sid: str, st: SandboxReclaim, now: float) -> int:
        if self.ensure_swap is not None:  # set up at the first reclaim (seconds at most)
            await asyncio.to_thread(self.ensure_swap)
        before = await self.backend.memory(sid)
        moved = int(await self.backend.reclaim(sid, None))
        after = await self.backend.memory(sid)
        self._freed.append((now, moved))
        while now - self._freed[0][0] > 60.0:  # rate() reads 30 s at most
            self._freed.popleft()
        st.working_set = before.resident_bytes
        st.resident_after = after.resident_bytes
        st.faults_at_reclaim = after.major_faults
        st.last, st.read_at = after, now
        st.reclaimed, st.reclaimed_at = True, now
        st.reclaimed_bytes += moved
        st.reclaims += 1
        st.recheck_every = self.cfg.recheck_s
        st.next_check = now + self.cfg.recheck_s
        if self.on_reclaimed is not None:
            self.on_reclaimed(sid, moved)
        return moved

    # -- passes ---------------------------------------------------------------------------

    def _stall_pct(self, now: float) -> float:
        """Percent of wall time some task stalled on memory since the previous call."""
        psi = hostmem.read_psi(self.psi_path)
        if psi is None:
            return 0.0
        prev, self._psi_total = self._psi_total, (now, psi.some.total_us)
        if prev is None or now <= prev[0]:
            return psi.some.avg10
        return max(0.0, (psi.some.total_us - prev[1]) / 1e6 / (now - prev[0]) * 100.0)

    def rate(self, window_s: float = 30.0) -> float:
        """Bytes a second reclaim freed over the last ``window_s`` (≤ 60; 0.0: none)."""
        now = self.clock()
        return sum(b for t, b in self._freed if now - t <= window_s) / window_s

    def _pace(self, stall: float) -> None:
        cap = int(self.cfg.rate_bytes * self.cfg.interval_s)
        floor = 16 << 20
        if stall > self.cfg.psi_target:
            self.budget = max(floor, self.budget // 2)
        elif stall < self.cfg.psi_target / 2:
            self.budget = min(cap, max(floor, self.budget + self.budget // 4))

    def _deficit(self) -> int:
        """Bytes MemAvailable is below ``low_bytes`` (0: no shortage)."""
        if self.cfg.low_bytes <= 0:
            return 0
        try:
            avail = hostmem.meminfo(self.meminfo_path).get("MemAvailable", 1 << 62)
        except OSError:
            return 0
        return max(0, self.cfg.low_bytes - avail)

    async def pass_once(self) -> PassResult:
        """One pass: find idle sandboxes that are due, reclaim them within the budget."""
        now = self.clock()
        res = PassResult(stall_pct=self._stall_pct(now))
        self._pace(res.stall_pct)
        deficit = self._deficit()
        short = deficit > 0
        # short of memory: at least the deficit this pass, whatever the pressure
        budget = min(max(self.budget, deficit), int(self.cfg.rate_bytes * self.cfg.interval_s))\
            if short else self.budget
        res.budget = budget
        self.passes += 1
        if not self.cfg.enabled or not self.supported:
            return res
        if self._full_backoff > 0 and await self._swap_still_full(now):
            res.swap_full = self.swap_full
            return res
        idle_after = min(self.cfg.idle_after_s, self.cfg.short_idle_after_s) if short \
            else self.cfg.idle_after_s
        live = {r.id: r for r in self.records()}
        for sid in list(self.state):
            if sid not in live:
                del self.state[sid]
        due: list[tuple[int, str, SandboxReclaim]] = []
        for sid, rec in live.items():
            st = self._st(sid)
            if rec.paused:
                continue
            if rec.active_execs > 0:
                st.cpu_mark = None
                continue
            quiet_since = rec.last_active
            if now - quiet_since < idle_after or now < st.next_check:
                continue
            try:
                use = await self.backend.memory(sid)
            except EdgedError:
                continue
            st.last, st.read_at = use, now
            # CPU demand: what it ran and what it waited to run (starved of CPU, as a
            # best-effort sandbox on a busy node is, it uses little and is not idle)
            demand = use.cpu_usage_ns + use.cpu_wait_ns
            if st.cpu_mark is None or st.cpu_mark[0] < quiet_since:
                # the CPU window starts now; judged once it is idle_after_s long
                st.cpu_mark = (now, demand)
                st.next_check = now + idle_after
                continue
            t0, c0 = st.cpu_mark
            busy = max(0, demand - c0) / 1e9 / max(1e-6, now - t0)
            st.cpu_mark = (now, demand)
            if busy > self.cfg.idle_cpu:
                st.reclaimed = False  # active in the background: look again later
                st.recheck_every = 0.0
                st.next_check = now + idle_after
                continue
            if st.reclaimed and use.resident_bytes < st.resident_after + self.cfg.regrow_bytes:
                # as it was: look again after twice as long (see the module)
                st.recheck_every = min(self.cfg.recheck_max_s,
                                       max(self.cfg.recheck_s, 2 * st.recheck_every))
                st.next_check = now + st.recheck_every
                continue
            due.append((use.resident_bytes, sid, st))
        if short:
            due.sort(key=lambda x: -x[0])  # biggest first when memory is short
        room = await self._room() if due else None
        spent = 0
        for resident, sid, st in due:
            if spent >= budget:
                break
            need = st.last.anon_bytes + st.last.shmem_bytes
            if room is not None and need > room:
                res.swap_full += 1  # no room in swap: look again later
                st.next_check = now + self.cfg.recheck_s
                continue
            if room is not None:
                room -= need
            try:
                async with self._lock:
                    moved = await self._reclaim(sid, st, now)
            except EdgedError as e:
                log.warning("reclaim: sandbox %s: %s", sid, e)
                st.next_check = now + self.cfg.recheck_s
                continue
            spent += max(resident, PAGE)
            res.reclaimed.append(sid)
            res.bytes += moved
        self.swap_full = res.swap_full
        if res.swap_full and not res.reclaimed:
            self._full_need = min(x.last.anon_bytes + x.last.shmem_bytes
                                  for _r, _s, x in due)
            self._back_off(now)
        else:
            self._full_backoff = 0.0
        return res

    def _back_off(self, now: float) -> None:
        self._full_backoff = min(self.cfg.recheck_max_s,
                                 max(2 * self.cfg.interval_s, 2 * self._full_backoff))
        self._full_until = now + self._full_backoff

    async def _swap_still_full(self, now: float) -> bool:
        """With swap found full (no room for any sandbox due): whether it still is. No
        sandbox is looked at (each look reads its cgroup's files, and each reclaim into a
        zram device at its RAM limit compresses pages only to fail them: the daemon spent a
        whole core so): until ``_full_until`` nothing at all, then the room alone (a few
        reads of ``/proc/swaps`` and ``mm_stat``), the wait doubling from two passes up to
        ``recheck_max_s`` while it stays full; a sandbox deleted ends the wait."""
        if now < self._full_until:
            return True
        room = await self._room()
        if room is not None and room < max(PAGE, self._full_need):
            self._back_off(now)
            return True
        self._full_backoff = 0.0
        return False

    async def _room(self) -> int | None:
        """Bytes of pages swap can take now, the swap set up first if it is not yet."""
        if self.swap_room is None:
            return None
        if self.ensure_swap is not None:
            await asyncio.to_thread(self.ensure_swap)
        return await asyncio.to_thread(self.swap_room)

    def start(self) -> None:
        """Run :meth:`pass_once` every ``interval_s`` until :meth:`stop`."""
        self._loop.start()

    async def stop(self) -> None:
        """Stop the pass loop."""
        await self._loop.stop()

    # -- reporting ------------------------------------------------------------------------

    def idle_bytes(self) -> int:
        """Bytes reclaim would move to swap if it reclaimed the idle sandboxes not reclaimed
        yet now: their anonymous and tmpfs memory (last read, at most 10 minutes ago)."""
        now = self.clock()
        total = 0
        for st in self.state.values():
            if not st.reclaimed and st.cpu_mark is not None and now - st.read_at < 600:
                total += st.last.anon_bytes + st.last.shmem_bytes
        return total

    def refault_rate(self, now: float | None = None) -> float | None:
        """Major faults per minute of the reclaimed sandboxes since their reclaim, as a share
        (percent) of their working sets; None before any has been reclaimed a minute."""
        now = self.clock() if now is None else now
        faults = ws = 0.0
        minutes = 0.0
        for st in self.state.values():
            if st.reclaimed and now - st.reclaimed_at >= 60 and st.working_set > 0:
                faults += max(0, st.last.major_faults - st.faults_at_reclaim) * PAGE
                ws += st.working_set
                minutes = max(minutes, (st.read_at - st.reclaimed_at) / 60.0)
        if ws <= 0 or minutes <= 0:
            return None
        return faults / ws / minutes * 100.0

    def totals(self) -> dict[str, int]:
        """``sandboxes_reclaimed`` (now), ``reclaimed_bytes`` (sum over all reclaims),
        ``wakes``, and the last-read ``resident_bytes``/``swap_bytes`` of all sandboxes."""
        out = {"sandboxes_reclaimed": 0, "reclaimed_bytes": 0, "wakes": 0,
               "resident_bytes": 0, "swap_bytes": 0}
        for st in self.state.values():
            out["sandboxes_reclaimed"] += int(st.reclaimed)
            out["reclaimed_bytes"] += st.reclaimed_bytes
            out["wakes"] += st.wakes
            out["resident_bytes"] += st.last.resident_bytes
            out["swap_bytes"] += st.last.swap_bytes
        return out
